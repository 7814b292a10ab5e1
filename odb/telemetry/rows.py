"""The rows of ``metrics.jsonl``: one per step, made on rank 0 from the step's plan (known to every
rank) and every rank's report of it; one per evaluation."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from odb.telemetry.flops import FlopsModel
from odb.telemetry.reports import Step

__all__ = ["aux_loss", "eval_row", "rewards", "step_loss", "step_row"]


def step_loss(step: Step, per_rank: Mapping[str, np.ndarray]) -> float:
    """The step's loss per label token over every rank (what the step trained: I4); a preference
    objective's per pair (:mod:`odb.training.step.preference`)."""
    count = step.plan.num_samples if _is_preference(per_rank) else step.plan.num_label_tokens
    return float(per_rank["loss_sum_micro"].sum()) / 1e6 / max(1, count)


def _is_preference(per_rank: Mapping[str, np.ndarray]) -> bool:
    return bool((per_rank["ranked_right"] >= 0).all())


def rewards(step: Step, per_rank: Mapping[str, np.ndarray]) -> dict[str, float]:
    """A preference objective's step metrics, means over the step's pairs on every rank (TRL's
    names): the chosen and rejected answers' rewards, their margin, and the share of pairs whose
    chosen reward is the higher; none for next-token loss."""
    if not _is_preference(per_rank):
        return {}
    pairs = max(1, step.plan.num_samples)
    chosen, rejected = (float(per_rank[f"{name}_reward_micro"].sum()) / 1e6 / pairs for name in ("chosen", "rejected"))
    return {"rewards/chosen": round(chosen, 6), "rewards/rejected": round(rejected, 6),
            "rewards/margins": round(chosen - rejected, 6),
            "rewards/accuracies": round(int(per_rank["ranked_right"].sum()) / pairs, 6)}


def step_row(step: Step, per_rank: Mapping[str, np.ndarray], *, samples_done: int, dataset_size: int,
             max_tokens: int, skipped: Mapping[str, int], truncated: Mapping[str, int],
             flops: FlopsModel | None = None, sources: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The metrics of a trained step: ``per_rank``: every rank's report fields for it;
    ``samples_done``: the run's samples up to and including it; ``skipped`` / ``truncated``: the
    run's record counts as of its round; ``flops``: the model's, for ``mfu`` (where the device's
    peak is known); ``sources``: ``loss/<source>`` and ``label_tokens/<source>`` (a preference
    objective: ``pairs/<source>``) of the log interval the step ends (:mod:`odb.telemetry.sources`),
    after ``loss``."""
    plan, step_s = step.plan, step.times.step
    rank_costs = np.array(plan.rank_costs)  # [micro, world]
    rank_tokens = np.array(plan.rank_tokens)
    real = int(rank_tokens.sum())
    materialized = int(per_rank["materialized"].sum())
    micro = int((rank_tokens > 0).sum())
    per_rank_tokens = rank_tokens.sum(axis=0)
    slowest = rank_costs.max(axis=1).sum()
    loss = step_loss(step, per_rank)
    latest = int(per_rank["epoch"].max())
    return {
        "step": plan.step, "epoch": latest if latest >= 0 else plan.epoch, "time": round(step.times.ended, 3),
        "loss": round(loss, 6),
        **(sources or {}),
        **rewards(step, per_rank),
        **aux_loss(per_rank["aux_sum_micro"], real),
        "lr": step.lr, "samples": plan.num_samples, "samples_done": samples_done,
        "epochs_done": round(samples_done / dataset_size, 4) if dataset_size else None,
        "label_tokens": plan.num_label_tokens, "real_tokens": real, "materialized_tokens": materialized,
        "padding_ratio": round(1 - real / materialized, 6) if materialized else 0.0,
        "budget_fill": round(real / (micro * max_tokens), 6) if micro else 0.0,
        "micro_batches": micro, "dummy_micro_batches": int((rank_tokens == 0).sum()),
        "rank_tokens_min": int(per_rank_tokens.min()), "rank_tokens_mean": float(per_rank_tokens.mean()),
        "rank_tokens_max": int(per_rank_tokens.max()),
        "sync_efficiency": _balance(per_rank["forward_us"]),
        "planned_sync_efficiency": round(float(rank_costs.mean(axis=1).sum() / slowest), 6) if slowest else 1.0,
        "step_s": round(step_s, 6),
        "samples_per_s": round(plan.num_samples / step_s, 3) if step_s else 0.0,
        "tokens_per_s": round(real / step_s, 1) if step_s else 0.0,
        "materialized_tokens_per_s": round(materialized / step_s, 1) if step_s else 0.0,
        "data_wait_s": float(per_rank["wait_us"].max()) / 1e6, "odb_plan_s": float(per_rank["plan_us"].max()) / 1e6,
        "odb_collective_s": float(per_rank["collective_us"].max()) / 1e6,
        "forward_s": float(per_rank["forward_us"].max()) / 1e6, "skipped": dict(skipped),
        "truncated_samples": truncated["samples"], "truncated_tokens": truncated["tokens"],
        **_mfu(flops, tokens=real, attn_area=int(per_rank["attn_area"].sum()), seconds=step_s,
               world_size=len(per_rank_tokens)),
    }


def _balance(forward_us: np.ndarray) -> float:
    """Measured sync efficiency: the ranks' mean time in the step's forward passes over the
    slowest's (1.0: no time measured; why the forward: odb.training.step.clock.ForwardClock).
    ``planned_sync_efficiency`` is the same ratio of the cost model's estimates, per micro-batch
    position."""
    slowest = int(forward_us.max())
    return round(float(forward_us.mean()) / slowest, 6) if slowest > 0 else 1.0


def _mfu(flops: FlopsModel | None, **step: Any) -> dict[str, float]:
    mfu = flops.mfu(**step) if flops is not None else None
    return {} if mfu is None else {"mfu": round(mfu, 4)}


def aux_loss(aux_sum_micro: np.ndarray, real_tokens: int) -> dict[str, float]:
    """MoE: ``aux_loss`` = sum over ranks and micro-batches of router loss x real tokens, over the
    step's real tokens; nothing for a dense model (every rank reports -1)."""
    if (aux_sum_micro < 0).any():
        return {}
    return {"aux_loss": round(float(aux_sum_micro.sum()) / 1e6 / max(1, real_tokens), 6)}


def eval_row(step: int, *, loss: float | None, label_tokens: int, samples: int, seconds: float,
             over_cap: int, sources: Mapping[str, tuple[float | None, int]] | None = None,
             rewards: Mapping[str, float] | None = None) -> dict[str, Any]:
    """An evaluation's row: ``loss`` None (an eval set without label tokens) is written as null, as
    JSON has no NaN; ``over_cap``: samples over the cap, scored whole; ``sources`` (an eval set of
    several sources): per name its loss and label tokens, as ``eval_loss/<name>`` and
    ``eval_label_tokens/<name>``; ``rewards``: a preference objective's, as ``eval_rewards/<name>``."""
    by_source: dict[str, Any] = {f"eval_rewards/{name}": round(value, 6) for name, value in (rewards or {}).items()}
    for name, (source_loss, _) in (sources or {}).items():
        by_source[f"eval_loss/{name}"] = None if source_loss is None else round(source_loss, 6)
    for name, (_, tokens) in (sources or {}).items():
        by_source[f"eval_label_tokens/{name}"] = tokens
    return {"step": step, "eval_loss": None if loss is None else round(loss, 6), **by_source,
            "eval_label_tokens": label_tokens, "eval_samples": samples, "eval_over_cap": over_cap,
            "eval_s": round(seconds, 3), "time": round(time.time(), 3)}
