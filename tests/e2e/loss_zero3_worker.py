"""One rank of tests/e2e/test_loss_zero3.py, one process per rank (tests/launch.py, or by hand under torchrun).

Usage: torchrun --nproc_per_node 2 tests/e2e/loss_zero3_worker.py OUT_FOLDER

For each tiny model (Gemma-2: tied embeddings, final soft-capping 30; Qwen2 with LoRA on
attention and the LM head), under ZeRO-3 with every parameter partitioned (persistence threshold
0, so every call of the head gathers its weight): one step of :meth:`OdbEngine.train_step`, GAS 2,
with the full-logits loss and then with the chunked loss (8 chunks per micro-batch), on the same
plan. Rank 0 holds two real micro-batches of 103 and 90 tokens, rank 1 one of 37 and a dummy:
their scored tokens differ, the head calls must not. SGD at lr 0 keeps the weights; each step's
gradient is read, gathered, just before the optimizer step (``safe_get_full_grad``).

The oracle shares no odb code: the same model built again in this process, plain (no DeepSpeed,
the model's own eager attention), each sample of both ranks alone through its own ``labels=``
loss times its label count, summed and divided by the step's label tokens, and its gradient.
Each rank writes ``rank<R>.json``: per model, its micro-batches' loss sum in each mode and the
oracle's over the same samples, and each mode's largest gradient difference from the oracle.
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
from deepspeed.utils import safe_get_full_grad
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's odb, installed or not

from odb.batching.cost import SampleCost, count_label_tokens  # noqa: E402
from odb.batching.plan import MicroBatch, StepPlan
from odb.training.attention.varlen import register  # noqa: E402
from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402

TEXT = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.1,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
MODELS = {
    "gemma2": {"model_type": "gemma2", "sliding_window": 16, "final_logit_softcapping": 30.0,
               "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
    "qwen2_lora": {"model_type": "qwen2"},
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"]}
RANK_MICRO_BATCHES = [[[70, 33], [90]], [[25, 12], []]]  # sample lengths; [] = a dummy
MAX_TOKENS, CHUNK_TOKENS = 128, 16  # 8 chunks per micro-batch


def build(name: str, attention: str | None = None):
    """The tiny model with odb's attention (or ``attention``): the same weights on every rank and call."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TEXT, **MODELS[name]}),
                                             attn_implementation=attention or register()).train()
    if name.endswith("_lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
        for module in model.modules():  # B = 0 at init would leave the LoRA gradients one-sided
            if hasattr(module, "lora_B"):
                for layer in module.lora_B.values():
                    torch.nn.init.normal_(layer.weight, std=0.1)
    return model


def deepspeed_engine(model, world: int):
    config = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                                    "stage3_param_persistence_threshold": 0}}
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                      optimizer=torch.optim.SGD(params, lr=0.0))
    return engine


def plan_and_samples(rank: int) -> tuple[StepPlan, list[list[dict]]]:
    """The rank's micro-batches (random ids, labels = ids) and the step's global label tokens."""
    gen = torch.Generator().manual_seed(1)
    layout = [[[{"input_ids": torch.randint(10, 1000, (n,), generator=gen).tolist()} for n in micro]
               for micro in micros] for micros in RANK_MICRO_BATCHES]
    costs = [[tuple(SampleCost(uid=i, tokens=len(s["input_ids"]), label_tokens=count_label_tokens(s["input_ids"]),
                               patches=0, cost=len(s["input_ids"])) for i, s in enumerate(micro)) for micro in micros]
             for micros in layout]
    total = sum(c.label_tokens for micros in costs for micro in micros for c in micro)
    micro_batches = tuple(MicroBatch(samples=c) for c in costs[rank])
    num_samples = sum(len(micro) for micros in costs for micro in micros)
    plan = StepPlan(epoch=0, step=0, micro_batches=micro_batches, num_label_tokens=total, num_samples=num_samples,
                    rank_costs=((0, 0), (0, 0)), rank_tokens=((0, 0), (0, 0)))
    return plan, layout[rank]


def own_loss_sum(model, ids: list[int]) -> torch.Tensor:
    """The model's own loss on one sample alone (its mean over the shifted labels) times their count."""
    ids_t = torch.tensor([ids])
    return model(input_ids=ids_t, labels=ids_t).loss * (len(ids) - 1)


def oracle(name: str, rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    """This rank's samples' summed own loss, and the step's gradient: every sample of every rank,
    its own loss, over the step's label tokens."""
    model = build(name, attention="eager")
    layout = [plan_and_samples(r)[1] for r in range(len(RANK_MICRO_BATCHES))]
    sums = [sum((own_loss_sum(model, s["input_ids"]) for micro in micros for s in micro), torch.zeros(()))
            for micros in layout]
    (sum(sums) / plan_and_samples(rank)[0].num_label_tokens).backward()
    return float(sums[rank]), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def worst_difference(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict:
    """The largest difference from ``expected`` over every gradient, relative to its largest entry."""
    assert grads.keys() == expected.keys(), sorted(grads.keys() ^ expected.keys())
    rel, diff, name = max((float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12),
                           float((grads[n] - g).abs().max()), n) for n, g in expected.items())
    return {"rel": rel, "abs": diff, "worst": name}


def reading_grads(engine) -> list[dict[str, torch.Tensor]]:
    """Each later optimizer step's trained gradients, gathered whole just before the step
    (collective: every rank, the same parameters in order)."""
    grads: list[dict[str, torch.Tensor]] = []
    step = engine.step

    def step_reading_grads(*args, **kwargs):
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                      if p.requires_grad})
        return step(*args, **kwargs)

    engine.step = step_reading_grads
    return grads


def run(name: str, rank: int, world: int) -> dict:
    engine = deepspeed_engine(build(name), world)
    grads = reading_grads(engine)
    plan, samples = plan_and_samples(rank)
    losses = {}
    for mode, chunk in (("full", None), ("chunked", CHUNK_TOKENS)):
        trainer = OdbEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=MAX_TOKENS, pad_token_id=0,
                            loss_chunk_tokens=chunk)
        losses[mode] = trainer.train_step(plan, samples, lr=0.0).loss_sum
    losses["oracle"], expected = oracle(name, rank)
    return {"losses": losses, "num_grads": len(expected),
            "grads": {mode: worst_difference(g, expected) for mode, g in zip(("full", "chunked"), grads)},
            "grad_norm": float(sum(g.double().pow(2).sum() for g in expected.values()) ** 0.5)}


def main() -> None:
    out = Path(sys.argv[-1])  # (DeepSpeed's runner puts --local_rank first)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    try:
        result = {name: run(name, rank, world) for name in MODELS}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
