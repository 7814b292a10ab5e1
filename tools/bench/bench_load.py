#!/usr/bin/env python
"""Peak host memory per rank of building a random-init model for ZeRO-3: whole, then partitioned
by ``deepspeed.initialize`` (``--way full``: ``build_model`` without DeepSpeed's config, as odb did
before), or partitioned as it is constructed (``--way partitioned``: ``odb.training.backends.deepspeed.build_model``).

    python tools/bench/bench_load.py                   # a ~270M-parameter Llama, 2 CPU ranks, both ways
    python tools/bench/bench_load.py --layers 2 --hidden 256 --intermediate 688 --vocab 1024 --heads 4

Each way runs in fresh processes under the deepspeed launcher (``--num_gpus N``; CPU ranks on
gloo where there is no GPU), every rank building as odb does (``build_model``, then
``initialize_deepspeed`` with DeepSpeed's ``configs/ds_zero3.json`` resolved for N ranks) and
reporting its peak RSS (``ru_maxrss``, imports included: ``baseline`` is the peak before the build)
and the parameter bytes it holds after the build and after ``deepspeed.initialize``. The last line
of stdout is one JSON object.

On CPU the partitions live in host memory and glibc keeps much of what a partitioned build frees
(each module made whole, then cut to its partition) as free heap that RSS still counts: run with
``MALLOC_MMAP_THRESHOLD_=1048576`` (big blocks mapped and returned on free) to see what the ranks
hold rather than what the allocator kept. Past the build, ``deepspeed.initialize`` adds ZeRO-3's
own flat copies (about 3.5 partitions in fp32), the same either way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WAYS = ("full", "partitioned")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--way", choices=(*WAYS, "both"), default="both",
                   help="full: the whole model on every rank first (odb before); partitioned: zero.Init")
    p.add_argument("--nproc", type=int, default=2, help="ranks (deepspeed --num_gpus)")
    p.add_argument("--deepspeed_config", default=str(ROOT / "configs" / "ds_zero3.json"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=None, help="default: --heads")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--timeout_s", type=int, default=1200, help="per launch")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank: the report folder
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> dict:
    return {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads or args.heads,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rss_mb() -> float:
    """The resident set now (not the peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def held_param_mb(model) -> float:
    """The parameter bytes this rank holds: its ZeRO-3 partition of a partitioned tensor, else all."""
    held = 0
    for p in model.parameters():
        tensor = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        held += tensor.numel() * tensor.element_size()
    return held / 2**20


def worker(args: argparse.Namespace) -> None:
    """One rank: build as odb does, report the memory."""
    from datetime import timedelta

    import deepspeed
    import torch
    import torch.distributed as dist

    from odb.training.backends.deepspeed import build_model, initialize_deepspeed, release
    from odb.training.config.optimization import OptimizationSettings

    out = Path(args.worker)
    setup = json.loads((out / "setup.json").read_text())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    deepspeed.init_distributed(timeout=timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (code loaded before the baseline)

    baseline = peak_rss_mb()
    began = time.perf_counter()
    ds_config = setup["deepspeed"]
    model = build_model(out / "model.json", seed=0, vocab_size=setup["model"]["vocab_size"],
                        ds_config=ds_config if setup["way"] == "partitioned" else None)
    built_s, built_peak, built_rss = time.perf_counter() - began, peak_rss_mb(), rss_mb()
    built_held = held_param_mb(model)
    engine = initialize_deepspeed(OptimizationSettings(deepspeed=ds_config), model)
    report = {"rank": rank, "params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
              "baseline_rss_mb": baseline, "after_build_peak_rss_mb": built_peak, "after_build_rss_mb": built_rss,
              "peak_rss_mb": peak_rss_mb(), "param_mb_held_after_build": built_held,
              "param_mb_held": held_param_mb(engine.module), "build_s": built_s,
              "initialize_s": time.perf_counter() - began - built_s,
              "dtype": str(next(engine.module.parameters()).dtype).removeprefix("torch.")}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    release()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(way: str, args: argparse.Namespace, config: dict, ds_config: dict, folder: Path) -> list[dict]:
    """One way, in fresh rank processes: each rank's report."""
    out = folder / way
    out.mkdir()
    (out / "model.json").write_text(json.dumps(config))
    (out / "setup.json").write_text(json.dumps({"way": way, "model": config, "deepspeed": ds_config}))
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(args.nproc), "--master_port",
           str(free_port()), str(Path(__file__).resolve()), "--worker", str(out), "--timeout_s", str(args.timeout_s)]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout_s + 60)
    if proc.returncode != 0:
        raise SystemExit(f"the {way} launch failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]


def main(argv: list[str] | None = None) -> dict:
    args = _args(argv)
    if args.worker is not None:
        worker(args)
        return {}
    import torch

    from odb.training.backends.deepspeed_config import load_ds_config, resolve_ds_config

    ds_config = resolve_ds_config(load_ds_config(args.deepspeed_config), gas=1, world_size=args.nproc,
                                  use_bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                                  source=args.deepspeed_config)
    config = model_config(args)
    result: dict = {"params": None, "world_size": args.nproc,
                    "zero_stage": ds_config.get("zero_optimization", {}).get("stage", 0),
                    "model": {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads", "vocab_size")}}
    with tempfile.TemporaryDirectory(prefix="odb-bench-load-") as folder:
        for way in WAYS if args.way == "both" else (args.way,):
            ranks = launch(way, args, config, ds_config, Path(folder))
            result["params"], result["dtype"] = ranks[0]["params"], ranks[0]["dtype"]
            size = torch.tensor([], dtype=getattr(torch, ranks[0]["dtype"])).element_size()
            result["model_mb"] = round(result["params"] * size / 2**20, 1)
            prefix = "full_load" if way == "full" else "partitioned"
            for key, name in (("peak_rss_mb", "peak_rss_mb_per_rank"), ("baseline_rss_mb", "baseline_rss_mb_per_rank"),
                              ("after_build_peak_rss_mb", "after_build_peak_rss_mb_per_rank"),
                              ("after_build_rss_mb", "after_build_rss_mb_per_rank"),
                              ("param_mb_held_after_build", "param_mb_held_after_build_per_rank"),
                              ("param_mb_held", "param_mb_held_per_rank"), ("build_s", "build_s_per_rank")):
                result[f"{prefix}_{name}"] = [round(r[key], 1) for r in ranks]
            print(f"{way:>11}: peak RSS per rank {result[f'{prefix}_peak_rss_mb_per_rank']} MB "
                  f"(before the build {result[f'{prefix}_baseline_rss_mb_per_rank']}), parameters held "
                  f"after the build {result[f'{prefix}_param_mb_held_after_build_per_rank']} MB, after "
                  f"deepspeed.initialize {result[f'{prefix}_param_mb_held_per_rank']} MB; "
                  f"the whole model is {result['model_mb']} MB", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
