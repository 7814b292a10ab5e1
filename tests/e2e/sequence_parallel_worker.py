"""One rank of tests/e2e/test_sequence_parallel.py, one process per rank (tests/launch.py).

Usage: torchrun --nproc_per_node W tests/e2e/sequence_parallel_worker.py OUT_FOLDER

For each sequence-parallel size S in ``SIZES[W]`` and each tiny model (Qwen2 with LoRA: GQA 4:2; Gemma-2: a
sliding window of 16, soft-capping, tied embeddings; at the largest S also with activation
checkpointing, which runs each layer's all-to-all again in the backward), under ZeRO-3 with every parameter
partitioned: one step of :meth:`OdbEngine.train_step`, GAS 2, full-logits loss and chunked loss,
on the same plan. The W / S groups each run their own micro-batches: a packed row of several
samples whose bounds fall anywhere in the ranks' slices, one sample longer than a rank's budget
(it trains whole, split over the group), and on the second group a dummy. Samples come from two
sources, so the per-source losses are checked too. SGD at lr 0 keeps the weights; each step's
gradient is read, gathered, just before the optimizer step (``safe_get_full_grad``).

The oracle shares no odb code: the same model built again in this process, plain (no DeepSpeed,
no sequence parallelism, the model's own eager attention), each sample of every group alone
through its own ``labels=`` loss times its label count, summed and divided by the step's label
tokens, and its gradient.

Two mixture-of-experts models besides (their router loss is each slice's, so not the oracle's):
gpt-oss (attention sinks, one per head: each rank attends with its share of the heads) and
Qwen3-MoE, each evaluated (:meth:`OdbEngine.eval_step`: the token loss, against the oracle's),
then trained one step on rows of 3 and 5 tokens, which at S = 4 leave a rank a slice of padding
alone: every gradient must stay finite. Each rank writes ``rank<R>.json``: per size and model, the loss its
group reports in each mode and the oracle's, per source too, and each mode's largest gradient
difference from the oracle.
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
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's odb, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss_zero3_worker import (  # noqa: E402
    TEXT,
    build,
    deepspeed_engine,
    own_loss_sum,
    reading_grads,
    worst_difference,
)

from odb.batching.cost import SampleCost, count_label_tokens  # noqa: E402
from odb.batching.plan import MicroBatch, StepPlan
from odb.training.attention.varlen import register, route_through  # noqa: E402
from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402
from odb.training.step.sequence_parallel import setup  # noqa: E402

SIZES = {2: (2,), 4: (2, 4)}
RANK_TOKENS, CHUNK_TOKENS = 64, 16  # a rank's budget; the group's is S times it
# per group, its micro-batches' sample lengths ([] = a dummy): a packed row, and a sample over a rank's budget
GROUP_MICRO_BATCHES = [[[70, 33, 9], [120]], [[25, 12, 40], []]]
MODELS = ("qwen2_lora", "gemma2")  # (loss_zero3_worker.MODELS: Qwen2 with LoRA on attention and the head)
MOE = {"qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "router_aux_loss_coef": 0.1, "tie_word_embeddings": False},
       "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                   "router_aux_loss_coef": 0.1, "tie_word_embeddings": False}}
SHORT_ROWS = [[[{"input_ids": [11, 12, 13]}], [{"input_ids": [21, 22, 23, 24, 25]}]]]  # each group's GAS 2


def layout(groups: int) -> list[list[list[dict]]]:
    """Every group's micro-batches: random ids (labels = ids, the first not scored), sources alternating 0 / 1."""
    gen = torch.Generator().manual_seed(1)
    out, number = [], 0
    for micros in GROUP_MICRO_BATCHES[:groups]:
        group = []
        for micro in micros:
            samples = []
            for n in micro:
                ids = torch.randint(10, 1000, (n,), generator=gen).tolist()
                samples.append({"input_ids": ids, "labels": ids, "source": number % 2})
                number += 1
            group.append(samples)
        out.append(group)
    return out


def plan_of(samples: list[list[dict]], total: int, groups: int = 1) -> StepPlan:
    """One group's plan; every group trains micro-batches of these tokens (``rank_tokens``: the
    router loss's weights)."""
    costs = [tuple(SampleCost(uid=i, tokens=len(s["input_ids"]), label_tokens=count_label_tokens(s["input_ids"]),
                              patches=0, cost=len(s["input_ids"])) for i, s in enumerate(micro)) for micro in samples]
    tokens = tuple(sum(c.tokens for c in micro) for micro in costs)
    return StepPlan(epoch=0, step=0, micro_batches=tuple(MicroBatch(samples=c) for c in costs), num_label_tokens=total,
                    num_samples=sum(map(len, costs)), rank_costs=((0, 0), (0, 0)), rank_tokens=(tokens,) * groups)


def oracle(name: str, data: list[list[list[dict]]], group: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """The group's own-loss sums (in all, per source) and the step's gradient over every group's samples."""
    model = build(name, attention="eager")
    total = sum(len(s["input_ids"]) - 1 for micros in data for micro in micros for s in micro)
    sums = {}
    for g, micros in enumerate(data):
        for micro in micros:
            for s in micro:
                sums[g, s["source"]] = sums.get((g, s["source"]), 0) + own_loss_sum(model, s["input_ids"])
    (sum(sums.values()) / total).backward()
    mine = {source: float(value) for (g, source), value in sums.items() if g == group}
    return {"all": sum(mine.values()), "sources": mine}, {n: p.grad for n, p in model.named_parameters()
                                                          if p.requires_grad}


def run(name: str, size: int, rank: int, world: int, *, checkpointing: bool = False) -> dict:
    model = build(name)
    if checkpointing:  # as odb builds it (odb/training/model/build.py): each layer recomputed, its all-to-all too
        from odb.training.model.build import _checkpoint_activations

        _checkpoint_activations(model)
    engine = deepspeed_engine(model, world)
    sp = setup(engine.module, size, rank=rank, world_size=world)
    grads = reading_grads(engine)
    data = layout(world // size)
    total = sum(len(s["input_ids"]) - 1 for micros in data for micro in micros for s in micro)
    group = rank // size
    plan = plan_of(data[group], total)
    losses, sources = {}, {}
    for mode, chunk in (("full", None), ("chunked", CHUNK_TOKENS)):
        trainer = OdbEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=size * RANK_TOKENS, pad_token_id=0,
                            loss_chunk_tokens=chunk, sequence_parallel=sp)
        result = trainer.train_step(plan, data[group], lr=0.0)
        losses[mode] = result.loss_sum
        sources[mode] = dict(enumerate(result.source_loss))
    route_through(None)
    expected_loss, expected = oracle(name, data, group)
    return {"losses": {**losses, "oracle": expected_loss["all"]},
            "sources": {**sources, "oracle": expected_loss["sources"]},
            "grads": {mode: worst_difference(g, expected) for mode, g in zip(("full", "chunked"), grads)},
            "grad_norm": float(sum(g.double().pow(2).sum() for g in expected.values()) ** 0.5)}


def build_moe(name: str, attention: str | None = None):
    """A tiny mixture-of-experts model (loss_zero3_worker's sizes) with odb's attention (or ``attention``)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TEXT, **MOE[name]})
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention or register()).train()


def run_moe(name: str, size: int, rank: int, world: int) -> dict:
    engine = deepspeed_engine(build_moe(name), world)
    sp = setup(engine.module, size, rank=rank, world_size=world)
    grads = reading_grads(engine)
    data = layout(world // size)
    total = sum(len(s["input_ids"]) - 1 for micros in data for micro in micros for s in micro)
    group = rank // size
    trainer = OdbEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=size * RANK_TOKENS, pad_token_id=0,
                        loss_chunk_tokens=CHUNK_TOKENS, sequence_parallel=sp)
    engine.eval()
    loss, tokens = trainer.eval_step(plan_of(data[group], total), data[group])
    engine.train()
    short = SHORT_ROWS[0]
    groups = world // size
    labels = groups * sum(len(s["input_ids"]) - 1 for micro in short for s in micro)
    result = trainer.train_step(plan_of(short, labels, groups), short, lr=0.0)
    route_through(None)
    model = build_moe(name, attention="eager")
    own = sum(float(own_loss_sum(model, s["input_ids"])) for micro in data[group] for s in micro)
    return {"eval": {"loss": loss, "label_tokens": tokens, "oracle": own},
            "short_rows": {"loss": result.loss_sum, "aux": result.aux_sum,
                           "finite": all(bool(torch.isfinite(g).all()) for g in grads[0].values())}}


def main() -> None:
    out = Path(sys.argv[-1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    try:
        result = {f"S{size} {name}": run(name, size, rank, world) for size in SIZES[world] for name in MODELS}
        result[f"S{SIZES[world][-1]} gemma2 checkpointed"] = run("gemma2", SIZES[world][-1], rank, world,
                                                                 checkpointing=True)
        result.update({f"S{size} {name}": run_moe(name, size, rank, world) for size in SIZES[world] for name in MOE})
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)
