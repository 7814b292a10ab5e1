"""One rank of tests/e2e/test_long_sample_groups.py, one process per rank (tests/launch.py).

Usage: torchrun --nproc_per_node W tests/e2e/long_sample_worker.py OUT_FOLDER

over_cap 'sequence_parallel': one step of :meth:`OdbEngine.train_step` (GAS 2, ZeRO-3 with every
parameter partitioned, SGD at lr 0) on a plan where groups of ranks train long samples together
at some positions while the other ranks train their own micro-batches (or a dummy) at the same
positions. A rank budget is 64 tokens; at 2 ranks a sample of 120 tokens on both ranks, then
packed rows; at 4 ranks a sample of 100 on ranks 0-1 beside a packed row on rank 2 and a dummy on
rank 3, then a sample of 250 on all four. The owner of each long sample holds it; the others get it
from the owner inside the engine. Models: Qwen2 with LoRA and Gemma-2 (sliding window, softcap;
also with activation checkpointing, which runs each layer's all-to-all again in the backward),
each with the full-logits and the chunked loss; and Qwen3-MoE (its token loss; the router loss is
each slice's).

The oracle shares no odb code (tests/e2e/loss_zero3_worker.py's): the same model built again in
this process, plain, the model's own eager attention, each sample alone through its own
``labels=`` loss times its label count, summed over the step's samples, divided by the step's
label tokens, and its gradient. Each rank writes ``rank<R>.json``: per model its loss sums (each
mode), per source, and each mode's largest gradient difference from the oracle; and
``mismatch<R>.txt``: the error of a step whose plan says a shared sample is one token longer than
its owner holds (every rank of the group must stop, none wait).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's odb, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss_zero3_worker import build, deepspeed_engine, own_loss_sum, reading_grads, worst_difference  # noqa: E402
from sequence_parallel_worker import build_moe  # noqa: E402

from odb.batching.cost import SampleCost, count_label_tokens  # noqa: E402
from odb.batching.plan import MicroBatch, Shared, StepPlan
from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402
from odb.training.step.sequence_parallel import setup_groups  # noqa: E402

RANK_TOKENS, CHUNK_TOKENS = 64, 16
# per world size, per position, per rank: a list of sample lengths, or ("shared", owner, degree, length)
PLANS = {2: [[("shared", 1, 2, 120)] * 2, [[40, 20], [60]]],
         4: [[("shared", 0, 2, 100)] * 2 + [[30, 30], []], [("shared", 2, 4, 250)] * 4]}


def samples_of(world: int) -> dict[tuple[int, int], list[dict]]:
    """``(position, rank) -> samples`` as the plan lays them out (a shared sample: at its owner;
    random ids, labels = ids, sources alternating 0 / 1)."""
    gen = torch.Generator().manual_seed(3)
    out, number = {}, 0
    for p, ranks in enumerate(PLANS[world]):
        for r, entry in enumerate(ranks):
            lengths = [entry[3]] if isinstance(entry, tuple) and entry[1] == r else [] if isinstance(entry, tuple) \
                else entry
            out[p, r] = []
            for n in lengths:
                ids = torch.randint(10, 1000, (n,), generator=gen).tolist()
                out[p, r].append({"input_ids": ids, "labels": ids, "source": number % 2})
                number += 1
    return out


def plan_of(world: int, rank: int, samples: dict) -> StepPlan:
    micro, tokens = [], []
    for p, ranks in enumerate(PLANS[world]):
        entry = ranks[rank]
        shared = Shared(*entry[1:]) if isinstance(entry, tuple) else None
        costs = tuple(SampleCost(i, len(s["input_ids"]), count_label_tokens(s["input_ids"]), 0, len(s["input_ids"]))
                      for i, s in enumerate(samples[p, rank]))
        micro.append(MicroBatch(costs, shared=shared))
        tokens.append(tuple(sum(len(s["input_ids"]) for s in samples[p, r]) for r in range(world)))
    total = sum(len(s["input_ids"]) - 1 for group in samples.values() for s in group)
    return StepPlan(epoch=0, step=0, micro_batches=tuple(micro), num_label_tokens=total,
                    num_samples=sum(map(len, samples.values())), rank_costs=((0,) * world,) * 2,
                    rank_tokens=tuple(tokens))


def oracle(model, samples: dict) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Per source, the own-loss sum of every sample of the step; and the step's gradient."""
    total = sum(len(s["input_ids"]) - 1 for group in samples.values() for s in group)
    sums: dict[int, torch.Tensor] = {}
    for group in samples.values():
        for s in group:
            sums[s["source"]] = sums.get(s["source"], 0) + own_loss_sum(model, s["input_ids"])
    (sum(sums.values()) / total).backward()
    return {k: float(v) for k, v in sums.items()}, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def run(name: str, rank: int, world: int, *, checkpointing: bool = False) -> dict:
    model = build_moe(name) if name == "qwen3_moe" else build(name)
    if checkpointing:  # as odb builds it (odb/training/model/build.py): each layer recomputed, its all-to-all too
        from odb.training.model.build import _checkpoint_activations

        _checkpoint_activations(model)
    engine = deepspeed_engine(model, world)
    groups = setup_groups(engine.module, tuple(d for d in (2, 4) if d <= world), rank=rank, world_size=world)
    grads = reading_grads(engine)
    samples = samples_of(world)
    plan = plan_of(world, rank, samples)
    mine = [samples[p, rank] for p in range(len(PLANS[world]))]
    losses, sources = {}, {}
    for mode, chunk in (("full", None), ("chunked", CHUNK_TOKENS)):
        trainer = OdbEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=RANK_TOKENS, pad_token_id=0,
                            loss_chunk_tokens=chunk, groups=groups, rank=rank)
        result = trainer.train_step(plan, mine, lr=0.0)
        losses[mode], sources[mode] = result.loss_sum, dict(enumerate(result.source_loss))
        if result.aux_sum is not None:
            losses[f"{mode} router"] = result.aux_sum
    plain = build_moe(name, attention="eager") if name == "qwen3_moe" else build(name, attention="eager")
    own, expected = oracle(plain, samples)
    return {"losses": losses, "sources": sources, "oracle": own,
            "grads": {mode: worst_difference(g, expected) for mode, g in zip(("full", "chunked"), grads)},
            "finite": all(bool(torch.isfinite(g).all()) for step in grads for g in step.values())}


def run_mismatch(rank: int, world: int) -> str:
    """A plan whose shared sample (on all ranks) is one token longer than the sample its owner holds:
    every rank of the group must stop with the reason, none wait. Returns the error (or "none")."""
    engine = deepspeed_engine(build("qwen2_lora"), world)
    groups = setup_groups(engine.module, (world,), rank=rank, world_size=world)
    held = [{"input_ids": list(range(10, 10 + 3 * RANK_TOKENS // 2))}] if rank == 0 else []
    wrong = MicroBatch((SampleCost(0, 3 * RANK_TOKENS // 2 + 1, 10, 0, 1),) if rank == 0 else (),
                       shared=Shared(0, world, 3 * RANK_TOKENS // 2 + 1))
    plan = StepPlan(epoch=0, step=0, micro_batches=(wrong, MicroBatch(())), num_label_tokens=10, num_samples=1,
                    rank_costs=((0,) * world,) * 2, rank_tokens=((0,) * world,) * 2)
    trainer = OdbEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=RANK_TOKENS, pad_token_id=0,
                        groups=groups, rank=rank)
    try:
        trainer.train_step(plan, [held, []], lr=0.0)
    except RuntimeError as err:
        return str(err)
    return "none"


def main() -> None:
    out = Path(sys.argv[-1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    try:
        result = {name: run(name, rank, world) for name in ("qwen2_lora", "gemma2", "qwen3_moe")}
        result["gemma2 checkpointed"] = run("gemma2", rank, world, checkpointing=True)
        mismatch = run_mismatch(rank, world)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        (out / f"mismatch{rank}.txt").write_text(mismatch)
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)
