"""One rank of tests/e2e/test_preference_ranks.py, one process per rank (tests/launch.py, or by hand).

Usage: torchrun --nproc_per_node 2 tests/e2e/preference_ranks_worker.py OUT_FOLDER

One optimizer step of a preference objective (odb.training.step.preference) through
:meth:`OdbEngine.train_step`, GAS 2, under DeepSpeed ZeRO-3 with every parameter partitioned
(persistence threshold 0: every module call, the reference's too, is a collective gather) and then
under FSDP2 (odb's own build: meta init on every rank, rank 0's weights broadcast), in one launch.
Uneven pairs: rank 0 holds micro-batches of 3 and 1 pairs, rank 1 one of 1 pair and a dummy, so
each rank's share of the step's 5 pairs differs, and the dummy must make the same model calls (the
reference's too) as a real micro-batch. The cases (:data:`CASES`): DPO on a Qwen2 with LoRA on
attention and the LM head, its reference the base model (the adapter disabled; A and B random, so
policy and reference differ); SimPO, a Gemma-2 full fine-tune (tied embeddings, soft-capping,
sliding window 16 under 52-token sequences), reference free; IPO, a Qwen2 full fine-tune, its
reference the records' log-probs; a Bradley-Terry reward model, a Qwen2 with LoRA on attention under
its score head (trained whole), TRL's RewardTrainer loss; DPO on a Qwen2-VL full fine-tune, its
prompts' images in both sequences (one pair's micro-batch text alone: odb's blank image), the
records' log-probs as reference. SGD at lr 0 keeps the weights; each step's gradient is read,
gathered whole, just before the optimizer step.

The oracle shares no odb code path under test (tests/preference_oracle.py): the same model built
again in this process, plain (no DeepSpeed, no FSDP2, the model's own eager attention), each pair
alone, TRL's own loss code, the mean over all 5 pairs of both ranks, and its gradient. Each rank
writes ``rank<R>.json``: per backend and case, its loss sum and rewards and the oracle's over the
same pairs, and the largest gradient difference from the oracle's.
"""

from __future__ import annotations

import json
import math
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
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from loss_zero3_worker import MODELS, TEXT, deepspeed_engine, reading_grads, worst_difference  # noqa: E402
from test_attention import IMAGE_IDS, VL_FAMILIES  # noqa: E402
from test_preference_vl import alone_logps as alone_vl_logps  # noqa: E402
from test_preference_vl import vl_pair  # noqa: E402

from odb.batching.cost import SampleCost, count_label_tokens  # noqa: E402
from odb.batching.plan import MicroBatch, StepPlan  # noqa: E402
from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.backends.fsdp2 import build_fsdp2  # noqa: E402
from odb.training.config.optimization import Fsdp2Settings, OptimizationSettings  # noqa: E402
from odb.training.config.settings import ModelSettings  # noqa: E402
from odb.training.model.build import build_model  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402
from odb.training.step.preference import Preference  # noqa: E402
from odb.training.step.reward import Reward  # noqa: E402
from preference_oracle import alone_logps, answer_tokens, pair, trl_loss, trl_reward_loss  # noqa: E402

VOCAB = TEXT["vocab_size"]
CONFIGS = {"qwen2": {**TEXT, "model_type": "qwen2"}, "gemma2": {**TEXT, **MODELS["gemma2"]},
           "qwen2_vl": {**VL_FAMILIES["qwen2_vl"], **IMAGE_IDS}}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"], "lora_dropout": 0.0,
        "init_lora_weights": False}  # A and B random: the policy is not its reference
CASES = {  # model, LoRA, objective
    "dpo_lora_adapter": ("qwen2", LORA, Preference("dpo", beta=0.1, reference="adapter")),
    "simpo_full": ("gemma2", None, Preference("simpo", beta=2.0, gamma=0.5, reference="none")),
    "ipo_full_data": ("qwen2", None, Preference("ipo", beta=0.1, reference="data")),
    "reward_lora": ("qwen2", {**LORA, "target_modules": ["q_proj", "v_proj"]}, Reward()),
    "dpo_vl_data": ("qwen2_vl", None, Preference("dpo", beta=0.1, reference="data")),
}
BACKENDS = ("deepspeed", "fsdp2")
RANK_PAIRS = [[3, 1], [1, 0]]  # pairs per micro-batch; 0 = a dummy
MAX_TOKENS, CHUNK_TOKENS = 128, 16  # 8 head chunks per model call; every sequence fits (at most 52 tokens)


def rank_samples(*, ref: bool, vl: bool = False) -> list[list[list[dict]]]:
    """Every rank's micro-batches of pair samples (the same on every rank and in the oracle);
    ``vl``: a vision-language model's, every prompt with an image but one pair's (its micro-batch
    gets odb's blank image)."""
    rng = random.Random(3)
    uids = iter(range(100))
    make = (lambda uid: vl_pair(rng, uid, image=uid != 1)) if vl else \
        (lambda uid: pair(rng, uid, ref=ref, vocab=VOCAB))  # noqa: E731
    return [[[make(next(uids)) for _ in range(n)] for n in micros] for micros in RANK_PAIRS]


def cost(sample: dict) -> SampleCost:
    tokens = len(sample["input_ids"])
    return SampleCost(uid=sample["uid"], tokens=tokens, label_tokens=count_label_tokens(sample["labels"].tolist()),
                      patches=0, cost=tokens)


def plan_of(layout: list[list[list[dict]]], rank: int) -> StepPlan:
    """This rank's plan: its micro-batches, the step's pairs on all ranks (``num_samples``)."""
    micro_batches = tuple(MicroBatch(samples=tuple(cost(s) for s in micro)) for micro in layout[rank])
    every = [s for micros in layout for micro in micros for s in micro]
    return StepPlan(epoch=0, step=0, micro_batches=micro_batches, num_samples=len(every),
                    num_label_tokens=sum(cost(s).label_tokens for s in every),
                    rank_costs=((0, 0), (0, 0)), rank_tokens=((0, 0), (0, 0)))


def oracle(path: Path, name: str) -> dict:
    """Per rank, the summed loss and rewards (chosen, rejected, ranked right) of its pairs, and
    the step's gradient: the mean over every pair of both ranks, each alone, TRL's loss."""
    model_name, lora, objective = CASES[name]
    scores = isinstance(objective, Reward)
    model = build_model(path, seed=0, vocab_size=VOCAB, lora=lora, score_head=scores)
    (model.get_base_model() if lora else model).set_attn_implementation("eager")
    layout = rank_samples(ref=objective.reference == "data", vl=model_name in VL_FAMILIES)
    losses, rewards = [], []
    for micros in layout:
        rank_losses, rank_rewards = [], [0.0, 0.0, 0]
        for sample in (s for micro in micros for s in micro):
            if scores:
                loss, reward = trl_reward_loss(model, sample)
                rank_losses.append(loss)
                rank_rewards = [rank_rewards[0] + float(reward[0]), rank_rewards[1] + float(reward[1]),
                                rank_rewards[2] + int(reward[0] > reward[1])]
                continue
            pi = alone_vl_logps(model, sample) if model_name in VL_FAMILIES else alone_logps(model, sample)
            n = answer_tokens(sample)
            if objective.reference == "adapter":
                with torch.no_grad(), model.disable_adapter():
                    rho = alone_logps(model, sample)
            elif objective.reference == "data":
                rho = [torch.tensor(v) for v in sample["ref_logps"]]
            else:
                rho = None
            rank_losses.append(trl_loss(objective.loss, objective.beta, objective.gamma, pi, rho, n))
            reward = [objective.beta * float((pi[k] - rho[k] if rho is not None else pi[k] / n[k]).detach())
                      for k in (0, 1)]
            rank_rewards = [rank_rewards[0] + reward[0], rank_rewards[1] + reward[1],
                            rank_rewards[2] + int(reward[0] > reward[1])]
        losses.append(rank_losses)
        rewards.append(rank_rewards)
    every = [loss for rank_losses in losses for loss in rank_losses]
    (sum(every) / len(every)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return {"loss_sums": [float(sum(ls, torch.zeros(()))) for ls in losses], "rewards": rewards, "grads": grads,
            "mean": float(sum(every) / len(every))}


def reading_fsdp2_grads(backend) -> list[dict[str, torch.Tensor]]:
    """As :func:`loss_zero3_worker.reading_grads`, for FSDP2: each step's reduced gradient
    shards gathered whole (``full_tensor``, collective) just before the optimizer step."""
    grads: list[dict[str, torch.Tensor]] = []
    step = backend.step

    def step_reading_grads():
        grads.append({n: p.grad.full_tensor().clone() for n, p in backend.module.named_parameters()
                      if p.requires_grad})
        step()

    backend.step = step_reading_grads
    return grads


def train_backend(kind: str, path: Path, lora: dict | None, rank: int, world: int, scores: bool):
    """The backend of ``kind`` over the model built from ``path`` (``scores``: a reward model's), and
    the list its step's gradients go to."""
    if kind == "deepspeed":
        engine = deepspeed_engine(build_model(path, seed=0, vocab_size=VOCAB, lora=lora, score_head=scores), world)
        return DeepSpeedBackend(engine), reading_grads(engine)
    optimization = OptimizationSettings(optimizer="sgd", lr=0.0, backend="fsdp2",
                                        fsdp2=Fsdp2Settings(mixed_precision="fp32", gradient_clipping=0.0))
    backend = build_fsdp2(ModelSettings(path=str(path), tokenizer="unused", lora=lora), optimization, seed=0,
                          vocab_size=VOCAB, rank=rank, score_head=scores)
    return backend, reading_fsdp2_grads(backend)


def run(kind: str, name: str, path: Path, expected: dict, rank: int, world: int) -> dict:
    model_name, lora, objective = CASES[name]
    scores = isinstance(objective, Reward)
    backend, grads = train_backend(kind, path, lora, rank, world, scores)
    trainer = OdbEngine(backend, world_size=world, max_tokens=MAX_TOKENS, pad_token_id=0,
                        loss_chunk_tokens=None if scores else CHUNK_TOKENS, objective=objective, rank=rank)
    layout = rank_samples(ref=objective.reference == "data", vl=model_name in VL_FAMILIES)
    result = trainer.train_step(plan_of(layout, rank), layout[rank], lr=0.0)
    (got,) = grads
    return {"loss_sum": result.loss_sum, "rewards": list(result.rewards), "grads": worst_difference(got, expected)}


def main() -> None:
    out = Path(sys.argv[-1])  # (DeepSpeed's runner puts --local_rank first)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(timeout=timedelta(seconds=60))  # a gather out of step fails within a minute
    rank = dist.get_rank()
    try:
        result: dict = {}
        for name, (model_name, _, _) in CASES.items():
            path = out / f"{model_name}.rank{rank}.json"
            path.write_text(json.dumps(CONFIGS[model_name]))
            expected = oracle(path, name)
            grads = expected.pop("grads")
            result[name] = {"oracle": {**expected, "loss_sum": expected["loss_sums"][rank],
                                       "rewards": expected["rewards"][rank], "num_grads": len(grads),
                                       "grad_norm": math.sqrt(sum(float(g.double().pow(2).sum())
                                                                  for g in grads.values()))}}
            for kind in BACKENDS:
                result[name][kind] = run(kind, name, path, grads, rank, world)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
