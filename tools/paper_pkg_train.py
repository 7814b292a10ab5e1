#!/usr/bin/env python
"""The paper's reference package (``online-dynamic-batching`` 0.1.2, import name ``odb``) training the
same model on the same samples as tools/bench_train.py's other systems, through its documented
DataLoader API. Run by bench_train.py in a virtual environment of its own (the two packages share
the import name), one process per rank under the deepspeed launcher:

    <venv>/bin/python -c "from deepspeed.launcher.runner import main; main()" --num_gpus 2 \\
        tools/paper_pkg_train.py --samples samples.pt --model MODEL_DIR --deepspeed_config ds.json \\
        --token_budget 2048 --out OUT

What it follows from the package's documentation (docs/integration-guides/pytorch-loop.md and
docs/runtime-settings.md): ``ODBDataLoader(dataset, token_budget=..., batch_size=1, num_workers,
prefetch_factor, collate_fn, loss_scaling="exact", join=True)`` over a ``DistributedSampler``;
``odb.pop_step_info(batch, loss_scaling="exact")`` before the forward; the model's mean loss times
``info.loss_scale``; one optimizer step per batch (the package has no gradient accumulation); the
learning rate from emitted-sample progress; and, because ranks may run out of batches at
different steps, "DDP Join or an equivalent guard": here one all_reduce per step of whether a rank
still has a batch, and a zero-weight pass on a rank that has none while another has one (what DDP
Join does for DDP; DeepSpeed has no Join).

This file must not import the project's own ``odb``: ``import odb`` here is the paper's package (the
learning-rate schedule is the project's, loaded from its file).
The samples come already tokenized (``--samples``, written by bench_train.py with the project's
processing), so this side does no tokenization of its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler
from transformers import AutoModelForCausalLM

import odb  # the paper's package, from this virtual environment

IDS_KEY = "bench_ids"


class TokenizedSamples(Dataset):
    """The bench's processed samples: each item a fresh dict, as a processing pipeline returns one."""

    def __init__(self, path: Path) -> None:
        self.samples = torch.load(path)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        sample = self.samples[index]
        return {"input_ids": sample["input_ids"].clone(), "labels": sample["labels"].clone(),
                IDS_KEY: int(sample["id"])}


class PadCollate:
    """Pads a group to its longest sample (the usual causal-LM collator) and carries the package's
    per-sample metadata into the batch, where ``odb.pop_step_info`` looks for it."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict]) -> dict:
        longest = max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), -100, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            input_ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": mask,
                 IDS_KEY: [s[IDS_KEY] for s in samples]}
        for key in (odb.TOTAL_BATCH_SIZE_KEY, odb.TOTAL_TOKENS_KEY):
            if key in samples[0]:
                batch[key] = samples[0][key]
        return batch


def project_schedule():
    """odb.training.schedule.ProgressSchedule, the other systems' learning-rate schedule, loaded from
    its file: ``import odb`` here is the paper's package, and the module needs nothing but ``math``."""
    spec = importlib.util.spec_from_file_location("project_schedule", Path(__file__).resolve().parent.parent
                                                  / "odb" / "training" / "schedule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ProgressSchedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--deepspeed_config", type=Path, required=True)
    parser.add_argument("--token_budget", type=int, required=True)
    parser.add_argument("--buffer", type=int, default=256, help="samples in the grouping window "
                        "(num_workers x prefetch_factor, the package's default buffer_size)")
    parser.add_argument("--num_workers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup_ratio", type=float, default=0.03)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's
    args = parser.parse_args()

    torch.multiprocessing.set_sharing_strategy("file_system")  # as the package's examples do
    deepspeed.init_distributed()  # gloo on CPU, as for the other systems
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    ds_config = json.loads(args.deepspeed_config.read_text())
    ds_config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world)
    ds_config.setdefault("bf16", {})["enabled"] = torch.cuda.is_available()  # as the other systems' "auto"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    dataset = TokenizedSamples(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = odb.ODBDataLoader(
        dataset, token_budget=args.token_budget, batch_size=1, sampler=sampler, num_workers=args.num_workers,
        prefetch_factor=max(1, args.buffer // args.num_workers), collate_fn=PadCollate(model.config.pad_token_id or 0),
        loss_scaling="exact", join=True)
    schedule = project_schedule()(args.lr, len(sampler) * world, warmup_ratio=args.warmup_ratio)

    counts = dict.fromkeys(("batches", "dummy_passes", "samples", "real_tokens", "materialized_tokens"), 0)
    loss_sums, label_counts, ids, waited = [], [], [], 0.0  # per step: loss sums stay tensors (no per-step sync)
    samples_done = 0
    device = engine.device
    dummy = {"input_ids": torch.zeros((1, 1), dtype=torch.long, device=device),
             "attention_mask": torch.ones((1, 1), dtype=torch.long, device=device)}
    engine.train()
    started = time.perf_counter()
    batches = iter(loader)
    exhausted = False
    while True:
        t0 = time.perf_counter()
        batch = None if exhausted else next(batches, None)
        exhausted = batch is None
        waited += time.perf_counter() - t0
        info = odb.pop_step_info(batch, loss_scaling="exact") if batch is not None else None
        # the uneven-input guard: does any rank still have a batch, and how many samples this step
        flags = torch.tensor([int(batch is not None), info.all_samples_this_step if info else 0], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not int(flags[0]):
            break
        for group in engine.optimizer.param_groups:
            group["lr"] = schedule(samples_done)
        samples_done += int(flags[1])
        if batch is None:  # this rank is out of batches while another is not: a zero-weight pass
            loss = engine(**dummy).logits.sum() * 0.0
            counts["dummy_passes"] += 1
            loss_sums.append(torch.zeros(()))
            label_counts.append(0)
        else:
            ids.append(batch.pop(IDS_KEY))  # the counts from the batch on the host, before it moves
            label_counts.append(int((batch["labels"][:, 1:] != -100).sum()))
            counts["batches"] += 1
            counts["samples"] += len(ids[-1])
            counts["real_tokens"] += int(batch["attention_mask"].sum())
            counts["materialized_tokens"] += batch["input_ids"].numel()
            out = engine(**{k: v.to(device) for k, v in batch.items()})
            loss_sums.append(out.loss.detach() * label_counts[-1])
            loss = out.loss * info.loss_scale
        engine.backward(loss)
        engine.step()
    wall_s = time.perf_counter() - started

    mine = {**counts, "wall_s": wall_s, "wait_s": waited, "loss_sums": [float(x) for x in loss_sums],
            "label_counts": label_counts, "ids": ids}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        write_summary(args.out, everyone, dataset_size=len(dataset))
    del batches, loader
    dist.barrier()
    dist.destroy_process_group()


def write_summary(out: Path, ranks: list[dict], *, dataset_size: int) -> None:
    """The run's figures under the same names as launch/train.py's summary.json, and each rank's
    emitted ids (emitted_ids.rank<R>.jsonl, one row per batch)."""
    out.mkdir(parents=True, exist_ok=True)
    total = {k: sum(r[k] for r in ranks) for k in ("batches", "dummy_passes", "samples", "real_tokens",
                                                    "materialized_tokens")}
    total["label_tokens"] = sum(sum(r["label_counts"]) for r in ranks)
    wall_s = sum(r["wall_s"] for r in ranks) / len(ranks)
    steps = len(ranks[0]["label_counts"])  # one entry per step, dummy passes included
    losses = [sum(r["loss_sums"][s] for r in ranks) / n
              for s in range(steps) if (n := sum(r["label_counts"][s] for r in ranks))]
    summary = {
        "world_size": len(ranks), "dataset_samples": dataset_size, "steps": steps,
        "micro_batches": total["batches"], "dummy_micro_batches": total["dummy_passes"],
        "samples_emitted": total["samples"], "real_tokens": total["real_tokens"],
        "materialized_tokens": total["materialized_tokens"],
        "padding_ratio": round(1 - total["real_tokens"] / max(1, total["materialized_tokens"]), 6),
        "label_tokens": total["label_tokens"],
        "loss_first": round(sum(losses[:3]) / max(1, len(losses[:3])), 5),
        "loss_last": round(sum(losses[-3:]) / max(1, len(losses[-3:])), 5),
        "wall_s": round(wall_s, 3), "samples_per_s": round(total["samples"] / max(1e-9, wall_s), 3),
        "tokens_per_s": round(total["real_tokens"] / max(1e-9, wall_s), 1),
        "data_wait_s": round(max(r["wait_s"] for r in ranks), 3), "policy": "paper_pkg",
        "package": f"online-dynamic-batching {odb.__version__}",
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for r, mine in enumerate(ranks):
        with open(out / f"emitted_ids.rank{r}.jsonl", "w") as f:
            for step, batch_ids in enumerate(mine["ids"]):
                f.write(json.dumps({"batch": step, "ids": batch_ids}) + "\n")


if __name__ == "__main__":
    main()
