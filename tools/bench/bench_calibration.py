#!/usr/bin/env python
"""The fitted cost model against the manual one, from real step times: how evenly the ranks' work
is balanced (the measured sync efficiency) when odb prices samples with coefficients fitted from
the run's own micro-batch times (``cost_model: "fit"``) and with the manual default (0: tokens
only).

    python tools/bench/bench_calibration.py --trace ../shared/traces/mmmix_like.txt --world_size 2 --json

The ranks are simulated in this process (odb's real batcher and round over a simulated group, one
rank computing at a time, so each rank's times are its own), and each rank trains every micro-batch
of its plan for real: a forward and backward of a small model (the bundled tiny Llama; the tiny
Qwen2-VL where the trace has vision patches) through odb's engine, on synthetic samples of the
trace's lengths (and images of its patch counts), its forward timed as the trainer times it
(:class:`odb.training.step.clock.ForwardClock`). The fit sees those times; the sync efficiency is
measured from them, as a run measures it: over the steps, the ranks' mean forward time of a step
over the slowest rank's (``micro_batch_sync_efficiency``: the same per micro-batch position, the
pace of ZeRO-3's and FSDP2's per-layer gathers). ``seconds``: the sum over steps of the slowest
rank's forward time, what a cluster would wait for.

Times on a CPU are noisy (the same micro-batch timed again differs by about 10% here), and the
measured figures carry that noise. So the plans are also judged without it: a law ``time ~ d +
a * tokens + b * sum(L^2) + c * patches`` fitted (free least squares) to every micro-batch time of
every mode, and each plan's sync efficiency with each micro-batch's time from the law
(``law_sync_efficiency``); ``law.noise``: the spread of the measured times about it (standard
deviation over the mean). Prints one JSON object with ``--json``::

    {"fit": {"sync_efficiency": ..., "coefficients": {...}, ...}, "manual": {"sync_efficiency": ...}, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.fit import features  # noqa: E402
from odb.batching.plan import StepPlan
from odb.batching.simulate import simulate  # noqa: E402
from odb.training.backends import LocalBackend  # noqa: E402
from odb.training.model.build import build_model  # noqa: E402
from odb.training.run.worst_case import image_sample, special_token_ids  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402
from tools.traces import read_lengths  # noqa: E402

TEXT_MODEL = ROOT / "configs" / "tiny_model.json"
VISION_MODEL = ROOT / "configs" / "tiny_vl_model.json"


class Samples:
    """Synthetic samples of a trace's lengths, made when trained (seeded by uid): ``tokens`` token
    ids (every label counts) and, for a sample with vision patches, an image of about that many
    patches among them."""

    def __init__(self, model, lengths: list[tuple[int, int]], max_tokens: int) -> None:
        self.config, self.lengths, self.max_tokens = model.config, lengths, max_tokens
        text_config = getattr(self.config, "text_config", self.config)
        avoid = special_token_ids(self.config)
        self.allowed = torch.tensor([i for i in range(text_config.vocab_size) if i not in avoid])

    def __call__(self, uid: int) -> dict:
        tokens, patches = self.lengths[uid % len(self.lengths)]
        tokens = min(tokens, self.max_tokens)  # (as the cost model cuts it; an image is never cut)
        generator = torch.Generator().manual_seed(uid)
        sample = image_sample(self.config, image_patches=patches) if patches else None
        if sample is not None and len(sample["input_ids"]) >= tokens:
            sample = None
        used = len(sample["input_ids"]) if sample else 0
        ids = self.allowed[torch.randint(len(self.allowed), (max(1, tokens - used),), generator=generator)]
        if sample is None:
            return {"input_ids": ids, "labels": ids.clone()}
        return {**sample, "input_ids": torch.cat([sample["input_ids"], ids]),
                "labels": torch.cat([sample["labels"], ids])}


def _balance(per_step: np.ndarray) -> float:
    """Steps' ``[world, steps]`` times: the ranks' mean over the slowest, summed over the steps."""
    return round(float(per_step.mean(axis=0).sum() / per_step.max(axis=0).sum()), 4) if per_step.size else 1.0


def run(mode: str, lengths: list[tuple[int, int]], *, world_size: int, max_tokens: int, gas: int, window: int,
        model_path: Path, seed: int, epochs: int) -> dict:
    """One simulated run under ``mode`` ('fit' or 'manual'): its measured balance and fit, over the
    whole run and over its last epoch (with several: the fit in effect from its start)."""
    model = build_model(model_path, seed=seed, vocab_size=0)
    engine = OdbEngine(LocalBackend(model), world_size=world_size, max_tokens=max_tokens, pad_token_id=0)
    make = Samples(model, lengths, max_tokens)
    config = OdbConfig(max_tokens=max_tokens, window=window, gas=gas, lookahead=window // 2, cost_model=mode,
                       seed=seed)

    def train(rank: int, step: StepPlan) -> list[float]:
        samples = [[make(uid) for uid in micro.uids] for micro in step.micro_batches]
        seconds = engine.train_step(step, samples, lr=0.0).forward_seconds
        model.zero_grad(set_to_none=True)
        return list(seconds)

    simulate(config, lengths[:2 * world_size], world_size, train=train)  # warm-up: first calls are slow
    began = time.perf_counter()
    result = simulate(config, lengths, world_size, train=train, num_epochs=epochs, timeout_s=24 * 3600)
    micro = [[(features(m)[:3], t) for plan, seconds in zip(rank_steps, rank_seconds, strict=True)
              for m, t in zip(plan.micro_batches, seconds, strict=True)]
             for rank_steps, rank_seconds in zip(result.steps, result.seconds, strict=True)]
    per_step = np.array([[sum(step) for step in rank] for rank in result.seconds])  # [world, steps]
    per_micro = np.array([[t for step in rank for t in step] for rank in result.seconds])  # [world, micro]
    fitted = result.batchers[0].cost_fit
    last = np.array([plan.epoch == epochs - 1 for plan in result.steps[0]])
    return {
        "sync_efficiency": _balance(per_step),
        "micro_batch_sync_efficiency": round(float(per_micro.mean(axis=0).sum() / per_micro.max(axis=0).sum()), 4),
        "seconds": round(float(per_step.max(axis=0).sum()), 2),
        "steps": int(per_step.shape[1]),
        "coefficients": {"attn_coef": result.batchers[0].cost_model.attn_coef,
                         "patch_coef": result.batchers[0].cost_model.patch_coef,
                         "r2": fitted.r2 if fitted else None, "micro_batches": fitted.observations if fitted else None},
        "wall_s": round(time.perf_counter() - began, 1),
        "last_epoch": {"sync_efficiency": _balance(per_step[:, last]), "steps": int(last.sum()),
                       "seconds": round(float(per_step[:, last].max(axis=0).sum()), 2)},
        "_micro": micro, "_gas": gas, "_last": last,
    }


def law_balance(runs: dict[str, dict]) -> dict:
    """The law of the module docstring, fitted to every run's micro-batch times, and each run's
    sync efficiency with its micro-batches timed by the law (step by step, as measured)."""
    rows = [(*f, t) for run in runs.values() for rank in run["_micro"] for f, t in rank if f[0]]
    data = np.array(rows, dtype=np.float64)
    design = np.column_stack([np.ones(len(data)), data[:, :3]])
    coef, *_ = np.linalg.lstsq(design, data[:, 3], rcond=None)
    noise = float(np.std(design @ coef - data[:, 3]) / data[:, 3].mean())
    dummy = float(np.mean([t for run in runs.values() for rank in run["_micro"] for f, t in rank if not f[0]] or [0]))
    for run in runs.values():
        gas, last = run.pop("_gas"), run.pop("_last")
        timed = np.array([[coef @ (1, *f) if f[0] else dummy for f, _ in rank] for rank in run.pop("_micro")])
        steps = timed.reshape(timed.shape[0], -1, gas).sum(axis=2)  # [world, steps]
        run["law_sync_efficiency"] = _balance(steps)
        run["last_epoch"]["law_sync_efficiency"] = _balance(steps[:, last])
    return {"d_s": round(float(coef[0]), 5), "a_s_per_token": float(f"{coef[1]:.4g}"),
            "b_s_per_token2": float(f"{coef[2]:.4g}"), "c_s_per_patch": float(f"{coef[3]:.4g}"),
            "noise": round(noise, 4), "micro_batches": len(data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a length trace: one 'tokens [vision_patches]' per line")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--samples", type=int, default=160, help="the trace's first N samples")
    parser.add_argument("--max_tokens", type=int, default=4096)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=1, help="passes over the samples (last_epoch: the last's "
                                                               "steps, the fit in effect from its start)")
    parser.add_argument("--model", default=None, help="a model config JSON (default: the bundled tiny text "
                                                      "model, or the tiny Qwen2-VL for a trace with patches)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier times)")
    parser.add_argument("--modes", default="fit,manual")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = read_lengths(args.trace)[:args.samples]
    model = Path(args.model) if args.model else VISION_MODEL if any(p for _, p in lengths) else TEXT_MODEL
    out = {"trace": Path(args.trace).name, "world_size": args.world_size, "samples": len(lengths),
           "max_tokens": args.max_tokens, "gas": args.gas, "window": args.window, "epochs": args.epochs,
           "model": model.name,
           "threads": args.threads}
    for mode in args.modes.split(","):
        out[mode] = run(mode, lengths, world_size=args.world_size, max_tokens=args.max_tokens, gas=args.gas,
                        window=args.window, model_path=model, seed=args.seed, epochs=args.epochs)
    out["law"] = law_balance({mode: out[mode] for mode in args.modes.split(",")})
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {json.dumps(value)}")


if __name__ == "__main__":
    main()
