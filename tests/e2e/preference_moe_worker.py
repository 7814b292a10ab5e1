"""One rank of tests/e2e/test_preference_moe.py (tests/launch.py starts two).

Usage: torchrun --nproc_per_node 2 tests/e2e/preference_moe_worker.py OUT_FOLDER

One SimPO step of a tiny Qwen3-MoE with activation checkpointing under DeepSpeed ZeRO-3 (every
parameter partitioned), GAS 2: rank 0 holds two micro-batches of one pair, rank 1 one pair and a
dummy. A preference objective adds no router loss, so a real micro-batch's graph holds no router
logits; a dummy whose graph held them (0 x the router loss) made rank 1 recompute and gather its
checkpointed layers in another order than rank 0, and the step hung in a gather. The oracle: the
same model in one plain process (its own eager attention), each pair alone, TRL's loss, the mean
over the step's 3 pairs; each rank writes ``rank<R>.json`` (its loss sum, the oracle's, and the
gradient's worst difference from the oracle's)."""

from __future__ import annotations

import json
import os
import random
import sys
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's odb, installed or not
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss_zero3_worker import deepspeed_engine, reading_grads, worst_difference  # noqa: E402

from odb.batching.cost import SampleCost, count_label_tokens  # noqa: E402
from odb.batching.plan import MicroBatch, StepPlan  # noqa: E402
from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.model.build import build_model  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402
from odb.training.step.preference import Preference  # noqa: E402
from preference_oracle import alone_logps, answer_tokens, pair, trl_loss  # noqa: E402

QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
             "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.1,
             "initializer_range": 0.1, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 1}
OBJECTIVE = Preference("simpo", beta=2.0, gamma=0.5, reference="none")
RANK_PAIRS = [[1, 1], [1, 0]]  # pairs per micro-batch; 0 = a dummy


def layout() -> list[list[list[dict]]]:
    rng = random.Random(3)
    uids = iter(range(100))
    return [[[pair(rng, next(uids), ref=False) for _ in range(n)] for n in micros] for micros in RANK_PAIRS]


def cost(sample: dict) -> SampleCost:
    tokens = len(sample["input_ids"])
    return SampleCost(sample["uid"], tokens, count_label_tokens(sample["labels"].tolist()), 0, tokens)


def oracle(path: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each rank's summed pair loss and the step's gradient (the mean over every pair, each alone)."""
    model = build_model(path, seed=0, vocab_size=QWEN3_MOE["vocab_size"])
    model.set_attn_implementation("eager")
    losses = [[trl_loss("simpo", OBJECTIVE.beta, OBJECTIVE.gamma, alone_logps(model, s), None, answer_tokens(s))
               for micro in micros for s in micro] for micros in layout()]
    every = [loss for rank in losses for loss in rank]
    (sum(every) / len(every)).backward()
    return ([float(sum(rank)) for rank in losses],
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad})


def main() -> None:
    out = Path(sys.argv[-1])  # (DeepSpeed's runner puts --local_rank first)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(timeout=timedelta(seconds=60))  # a gather out of step fails within a minute
    rank = dist.get_rank()
    try:
        path = out / f"moe.rank{rank}.json"
        path.write_text(json.dumps(QWEN3_MOE))
        want_losses, want_grads = oracle(path)
        model = build_model(path, seed=0, vocab_size=QWEN3_MOE["vocab_size"], gradient_checkpointing=True)
        ds_engine = deepspeed_engine(model, world)
        grads = reading_grads(ds_engine)
        engine = OdbEngine(DeepSpeedBackend(ds_engine), world_size=world, max_tokens=128, pad_token_id=0,
                           loss_chunk_tokens=16, objective=OBJECTIVE, rank=rank)
        samples = layout()
        plan = StepPlan(epoch=0, step=0, micro_batches=tuple(MicroBatch(tuple(map(cost, m))) for m in samples[rank]),
                        num_samples=sum(RANK_PAIRS[0] + RANK_PAIRS[1]), num_label_tokens=1,
                        rank_costs=((0, 0), (0, 0)), rank_tokens=((0, 0), (0, 0)))
        result = engine.train_step(plan, samples[rank], lr=0.0)
        (got,) = grads
        (out / f"rank{rank}.json").write_text(json.dumps({"loss_sum": result.loss_sum, "oracle": want_losses[rank],
                                                          "grads": worst_difference(got, want_grads)}))
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
