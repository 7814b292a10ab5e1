#!/usr/bin/env python
"""The paper's reference package (``online-dynamic-batching`` 0.1.2, import name ``odb``) training the
same model on the same samples as tools/bench/bench_train.py's other systems, through its documented
DataLoader API. Run by bench_train.py in a virtual environment of its own (the two packages share
the import name), one process per rank under the deepspeed launcher:

    <venv>/bin/python -c "from deepspeed.launcher.runner import main; main()" --num_gpus 2 \\
        tools/bench/paper_pkg_train.py --samples samples.pt --model MODEL_DIR --deepspeed_config ds.json \\
        --token_budget 2048 --out OUT

What it follows from the package's documentation (docs/integration-guides/pytorch-loop.md and
docs/runtime-settings.md): ``ODBDataLoader(dataset, token_budget=..., batch_size=1, num_workers,
prefetch_factor, collate_fn, loss_scaling="exact", join=True)`` over a ``DistributedSampler``;
``odb.pop_step_info(batch, loss_scaling="exact")`` before the forward; the model's mean loss times
``info.loss_scale``; the learning rate from emitted-sample progress; and, because ranks may run out
of batches at different steps, "DDP Join or an equivalent guard": here one all_reduce per batch of
whether a rank still has one, and a zero-weight pass on a rank that has none while another has one
(what DDP Join does for DDP; DeepSpeed has no Join).

The package has no gradient accumulation of its own. With ``--gas G`` (tools/bench/bench_quality.py, at
equal tokens per optimizer step) DeepSpeed accumulates G batches per optimizer step, as a user of
the package would have it do: the step's loss is the mean of its batches' exact losses
(DeepSpeed divides each by G), and an epoch's last step takes what is left (its boundary set by
hand: every rank looks one batch ahead; DeepSpeed still divides its k < G batches by G).
``--epochs E`` runs E passes (the sampler reshuffled each).
``--snapshot_steps K`` saves the weights every K optimizer steps and at the end
(``snapshots/step<N>.pt``, with the training time up to it in ``snapshots.json``; the time spent
saving is not counted), for tools/bench/eval_snapshots.py to score with the project's own evaluator.
``--count_only`` iterates the epochs' batches without a model and writes each rank's count per
epoch (``counts.json``), for bench_quality.py to size ``--gas``.

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
    """odb.training.run.schedule.ProgressSchedule, the other systems' learning-rate schedule, loaded from
    its file: ``import odb`` here is the paper's package, and the module needs nothing but ``math``."""
    spec = importlib.util.spec_from_file_location("project_schedule", Path(__file__).resolve().parents[2]
                                                  / "odb" / "training" / "run" / "schedule.py")
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
    parser.add_argument("--epochs", type=int, default=1, choices=range(1, 1000), metavar="E")
    parser.add_argument("--gas", type=int, default=1, help="batches per optimizer step (DeepSpeed accumulates)")
    parser.add_argument("--snapshot_steps", type=int, default=0, help="save the weights every N optimizer steps")
    parser.add_argument("--count_only", action="store_true", help="count one epoch's batches per rank, no model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher's
    args = parser.parse_args()

    torch.multiprocessing.set_sharing_strategy("file_system")  # as the package's examples do
    deepspeed.init_distributed()  # gloo on CPU, as for the other systems
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    dataset = TokenizedSamples(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    pad_id = json.loads((args.model / "config.json").read_text()).get("pad_token_id") or 0
    loader = odb.ODBDataLoader(
        dataset, token_budget=args.token_budget, batch_size=1, sampler=sampler, num_workers=args.num_workers,
        prefetch_factor=max(1, args.buffer // args.num_workers), collate_fn=PadCollate(pad_id),
        loss_scaling="exact", join=True)
    if args.count_only:
        count_batches(loader, sampler, args.epochs, args.out, rank=rank, world=world)
        return
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    ds_config = json.loads(args.deepspeed_config.read_text())
    ds_config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=args.gas,
                     train_batch_size=world * args.gas)
    ds_config.setdefault("bf16", {})["enabled"] = torch.cuda.is_available()  # as the other systems' "auto"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    schedule = project_schedule()(args.lr, len(sampler) * world * args.epochs, warmup_ratio=args.warmup_ratio)

    counts = dict.fromkeys(("batches", "dummy_passes", "samples", "real_tokens", "materialized_tokens"), 0)
    loss_sums, label_counts, ids, waited = [], [], [], 0.0  # per batch: loss sums stay tensors (no per-step sync)
    samples_done, optimizer_steps, in_step, saving = 0, 0, 0, 0.0
    snapshots: list[dict] = []
    device = engine.device
    dummy = {"input_ids": torch.zeros((1, 1), dtype=torch.long, device=device),
             "attention_mask": torch.ones((1, 1), dtype=torch.long, device=device)}
    engine.train()
    started = time.perf_counter()
    spent = []  # each epoch's iterator, kept: the package registers its worker pids under id(iterator),
    # and a new iterator at a freed one's address fails ("_set_worker_pids should be called only once")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        spent.append(batches)
        t0 = time.perf_counter()
        upcoming = next(batches, None)
        waited += time.perf_counter() - t0
        while True:
            batch, t0 = upcoming, time.perf_counter()
            upcoming = None if batch is None else next(batches, None)  # one ahead: is this the epoch's last?
            waited += time.perf_counter() - t0
            info = odb.pop_step_info(batch, loss_scaling="exact") if batch is not None else None
            # the uneven-input guard: does any rank still have a batch (this one, the next one), and
            # how many samples this pass
            flags = torch.tensor([int(batch is not None), info.all_samples_this_step if info else 0,
                                  int(upcoming is not None)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if not int(flags[0]):
                break
            if in_step == 0:  # a step's rate: from the samples before it (as launch/train.py sets it)
                for group in engine.optimizer.param_groups:
                    group["lr"] = schedule(samples_done)
            samples_done += int(flags[1])
            in_step += 1
            engine.set_gradient_accumulation_boundary(in_step == args.gas or not int(flags[2]))
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
            if in_step == args.gas or not int(flags[2]):
                in_step, optimizer_steps = 0, optimizer_steps + 1
                if args.snapshot_steps and optimizer_steps % args.snapshot_steps == 0:
                    saving += snapshot(engine, args.out, snapshots, optimizer_steps, rank=rank,
                                       trained_s=time.perf_counter() - started - saving, samples=samples_done)
    wall_s = time.perf_counter() - started - saving
    if args.snapshot_steps and (not snapshots or snapshots[-1]["step"] != optimizer_steps):
        snapshot(engine, args.out, snapshots, optimizer_steps, rank=rank, trained_s=wall_s, samples=samples_done)

    mine = {**counts, "wall_s": wall_s, "wait_s": waited, "loss_sums": [float(x) for x in loss_sums],
            "label_counts": label_counts, "ids": ids}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        write_summary(args.out, everyone, dataset_size=len(dataset), optimizer_steps=optimizer_steps)
    del batches, spent, loader
    dist.barrier()
    dist.destroy_process_group()


def count_batches(loader, sampler: DistributedSampler, epochs: int, out: Path, *, rank: int, world: int) -> None:
    """Each epoch's batches, counted (no model): every rank's counts in ``counts.json`` (rank 0 writes)."""
    mine, spent = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        spent.append(iter(loader))  # (kept: see main)
        mine.append(sum(1 for _ in spent[-1]))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "counts.json").write_text(json.dumps({"batches_per_rank": everyone}))
    dist.barrier()
    dist.destroy_process_group()


def snapshot(engine, out: Path, snapshots: list[dict], step: int, *, rank: int, trained_s: float,
             samples: int) -> float:
    """Rank 0 saves the weights after optimizer step ``step`` (ZeRO-1/2: every rank holds them
    whole) and rewrites ``snapshots.json``; returns the seconds it took (every rank waits for it)."""
    began = time.perf_counter()
    if rank == 0:
        folder = out / "snapshots"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in engine.module.state_dict().items()}, folder / f"step{step}.pt")
        snapshots.append({"step": step, "trained_s": round(trained_s, 4), "samples_done": samples,
                          "file": f"step{step}.pt"})
        (folder / "snapshots.json").write_text(json.dumps(snapshots, indent=1))
    else:
        snapshots.append({"step": step})
    dist.barrier()
    return time.perf_counter() - began


def write_summary(out: Path, ranks: list[dict], *, dataset_size: int, optimizer_steps: int) -> None:
    """The run's figures under the same names as launch/train.py's summary.json, and each rank's
    emitted ids (emitted_ids.rank<R>.jsonl, one row per batch)."""
    out.mkdir(parents=True, exist_ok=True)
    total = {k: sum(r[k] for r in ranks) for k in ("batches", "dummy_passes", "samples", "real_tokens",
                                                    "materialized_tokens")}
    total["label_tokens"] = sum(sum(r["label_counts"]) for r in ranks)
    wall_s = sum(r["wall_s"] for r in ranks) / len(ranks)
    passes = len(ranks[0]["label_counts"])  # one entry per batch pass, dummy passes included
    losses = [sum(r["loss_sums"][s] for r in ranks) / n
              for s in range(passes) if (n := sum(r["label_counts"][s] for r in ranks))]
    summary = {
        "world_size": len(ranks), "dataset_samples": dataset_size, "steps": optimizer_steps,
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
