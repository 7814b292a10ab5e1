"""A rank's run totals and the run's progress: counted at every step, kept across resumes (the
checkpoint's ``run_state.rank<R>.json``, :meth:`RunTotals.state_dict`), re-dealt to another number
of ranks, and summed over the ranks into ``summary.json`` (:meth:`RunTotals.summary`)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from odb.batching.plan import StepPlan
from odb.telemetry.reports import COUNTS
from odb.telemetry.sources import SourceTotals

__all__ = ["TRUNCATION_WARNING_SHARE", "RunTotals"]

TRUNCATION_WARNING_SHARE = 0.05
"""Warn (once, rank 0) when more than this share of the samples, or of their tokens, is cut."""


class RunTotals:
    """The run's progress (the same on every rank) and this rank's whole-run counts, resumes
    included; apart, this process's own."""

    def __init__(self, *, rank: int, dataset_size: int) -> None:
        self.rank, self.dataset_size = rank, dataset_size
        self.samples_done = self.steps_done = 0
        self.counts = dict.fromkeys(COUNTS, 0)
        self.first_losses: list[float] = []  # the run's first (up to 3) global step losses, from before a resume
        self.last_losses: list[float] = []  # its last (up to 3) before a resume (rank 0: from metrics.jsonl)
        self.skipped_before: Counter[str] = Counter()  # this rank's skipped records before a resume
        self.truncated_before: Counter[str] = Counter()  # this rank's data-worker cuts before a resume
        self.zero_label_steps = 0  # steps whose samples had no label token at all (the same on every rank)
        self.last_eval: dict[str, Any] | None = None  # the latest evaluation's row
        self.fetched_lost = (0, 0)  # the run's, as of the checkpoint (Telemetry keeps them up to date)
        self.sources = SourceTotals()  # this rank's samples and label tokens per source, whole run
        self.this_process = {"steps": 0, "samples": 0, "rounds": 0, "wall_s": 0.0}
        self.step_tokens = [0, 0, 0, 0]  # the run's steps, and the sum, least and most of their real tokens
        self._started: float | None = None  # while the train loop runs

    def start(self) -> None:
        """The train loop begins (its time counts into ``wall_s``)."""
        self._started = time.perf_counter()

    def stop(self) -> None:
        """The train loop has ended."""
        if self._started is not None:
            self.this_process["wall_s"] = time.perf_counter() - self._started
            self.counts["wall_us"] += round(self.this_process["wall_s"] * 1e6)
            self._started = None

    def record(self, plan: StepPlan) -> None:
        """This rank trained ``plan`` (once per step, in order)."""
        self.samples_done += plan.num_samples
        self.steps_done = plan.step + 1
        self.this_process["steps"] += 1
        self.this_process["samples"] += plan.num_samples
        if plan.num_samples and not plan.num_label_tokens:
            self.zero_label_steps += 1
            if self.rank == 0:
                print(f"odb: WARNING: step {plan.step} has {plan.num_samples} samples and no label token on any "
                      "rank: it trains nothing", file=sys.stderr, flush=True)
        tokens = sum(map(sum, plan.rank_tokens))  # (over all ranks: the same on every rank)
        steps, total, least, most = self.step_tokens
        self.step_tokens = [steps + 1, total + tokens, min(least, tokens) if steps else tokens, max(most, tokens)]
        t = self.counts
        t["steps"] += 1
        for micro in plan.micro_batches:
            t["label_tokens"] += micro.label_tokens
            t["micro_batches"] += not micro.is_dummy
            t["dummy_micro_batches"] += micro.is_dummy
            t["samples"] += len(micro.samples)
            t["long_samples"] += len(micro.samples) if micro.shared is not None else 0  # (at its owner)
            t["real_tokens"] += micro.tokens
            t["materialized_tokens"] += micro.materialized

    def summary(self, totals: Mapping[str, int], *, world_size: int, epochs: int | None, rounds: int,
                collectives: int, policy: str, losses: list[float], records: Mapping[str, Any],
                max_tokens: int) -> dict[str, Any]:
        """The whole run's figures (resumes included), and this process's apart.

        Args:
            totals: the final gather's sums over the ranks.
            epochs: the planned epochs (join mode), or None to count them from the samples trained.
            rounds: the run's rounds so far; ``collectives``: this process's.
            losses: rank 0's global per-step losses in this process.
            records: the run's ``skipped``, ``fetched`` and ``truncated`` record counts.
        """
        wall_s = totals["wall_us"] / 1e6 / world_size  # every rank's train loop, averaged
        first = (self.first_losses + losses)[:3]  # (a resume after fewer than 3 steps completes them here)
        last = (self.last_losses + losses)[-3:] or first[-3:]  # (a resume of fewer than 3 steps)
        mine = self.this_process
        if epochs is None:
            epochs = round(totals["samples"] / max(1, self.dataset_size), 4)
        cut = records["truncated"]
        cut_share = cut["tokens"] / max(1, cut["tokens"] + totals["real_tokens"])
        if self.rank == 0 and (cut_share > TRUNCATION_WARNING_SHARE
                               or cut["samples"] > TRUNCATION_WARNING_SHARE * max(1, records["fetched"])):
            print(f"odb: WARNING: {cut['samples']} samples were cut to max_tokens={max_tokens}, losing "
                  f"{cut['tokens']} tokens ({cut_share:.1%} of their tokens); raise max_tokens in the odb config",
                  file=sys.stderr, flush=True)
        return {
            "world_size": world_size, "dataset_samples": self.dataset_size or None, "epochs": epochs,
            "steps": self.steps_done, "micro_batches": totals["micro_batches"],
            "dummy_micro_batches": totals["dummy_micro_batches"], "samples_emitted": totals["samples"],
            "real_tokens": totals["real_tokens"], "materialized_tokens": totals["materialized_tokens"],
            "padding_ratio": round(1 - totals["real_tokens"] / max(1, totals["materialized_tokens"]), 6),
            "tokens_per_step": self._tokens_per_step(),
            "label_tokens": totals["label_tokens"], "truncated_samples": cut["samples"],
            "truncated_tokens": cut["tokens"], "long_samples": totals.get("long_samples", 0),
            "dropped": totals["dropped"], "skipped": records["skipped"],
            "zero_label_steps": self.zero_label_steps,
            "eval_loss": self.last_eval["eval_loss"] if self.last_eval else None,
            "loss_first": round(sum(first[:3]) / max(1, len(first[:3])), 5),
            "loss_last": round(sum(last) / max(1, len(last)), 5),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(totals["samples"] / max(1e-9, wall_s), 3),
            "tokens_per_s": round(totals["real_tokens"] / max(1e-9, wall_s), 1),
            "policy": policy, "rounds": rounds,
            "this_process": {
                "steps": mine["steps"], "samples": mine["samples"], "rounds": mine["rounds"],
                "odb_collectives": collectives,  # start check + one per round + the final gather
                "wall_s": round(mine["wall_s"], 3),
                "samples_per_s": round(mine["samples"] / max(1e-9, mine["wall_s"]), 3)},
        }

    def _tokens_per_step(self) -> dict[str, float] | None:
        """The real tokens of the run's optimizer steps over all ranks: mean, least, most (None
        before a step)."""
        steps, total, least, most = self.step_tokens
        return {"mean": round(total / steps, 1), "min": least, "max": most} if steps else None

    def state_dict(self, skipped: Mapping[str, int], truncated: Mapping[str, int], *, losses: list[float],
                   fetched_lost: tuple[int, int]) -> dict[str, Any]:
        """For a checkpoint, JSON-able: the run's progress and this rank's whole-run counts
        (``skipped``, ``truncated``: this process's data-worker counts; ``losses``: rank 0's step
        losses in this process; ``fetched_lost``: the run's record counts)."""
        running = round((time.perf_counter() - self._started) * 1e6) if self._started is not None else 0
        return {"samples_done": self.samples_done, "steps_done": self.steps_done,
                "totals": {**self.counts, "wall_us": self.counts["wall_us"] + running},
                "skipped": dict(self.skipped_before + Counter(skipped)),
                "truncated": dict(self.truncated_before + Counter(truncated)),
                "zero_label_steps": self.zero_label_steps, "last_eval": self.last_eval,
                "first_losses": (self.first_losses + losses)[:3],
                "fetched_lost": list(fetched_lost), "sources": self.sources.state_dict(),
                "step_tokens": list(self.step_tokens)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues the counts of a checkpoint's :meth:`state_dict` (a resumed run)."""
        self.samples_done = state["samples_done"]
        self.steps_done = state["steps_done"]
        self.counts.update(state["totals"])
        self.skipped_before = Counter(state["skipped"])
        self.truncated_before = Counter(state.get("truncated", {}))
        self.zero_label_steps = state.get("zero_label_steps", 0)
        self.last_eval = state.get("last_eval")
        self.first_losses = list(state["first_losses"])
        self.fetched_lost = tuple(state["fetched_lost"])
        self.step_tokens = list(state.get("step_tokens", [0, 0, 0, 0]))  # (none before global_batch_tokens)
        self.sources.load_state_dict(state.get("sources", {}))  # (none in a checkpoint of an older odb)

    @staticmethod
    def redeal_states(states: list[Mapping[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """Every old rank's :meth:`state_dict` as ``world_size`` new ranks' (a resume on another number
        of ranks): what each rank counted for itself (its totals, skipped and truncated records, its
        per-source counts) is summed on new rank 0, so the run's sums stay; the train-loop time is
        the old ranks' mean on every new rank, so its mean stays; the run's progress is every rank's
        alike."""
        totals = {k: sum(s["totals"][k] for s in states) for k in states[0]["totals"]}
        wall_us = totals["wall_us"] // len(states)
        out = []
        for r in range(world_size):
            mine = totals if r == 0 else dict.fromkeys(totals, 0)
            out.append({**states[0], "totals": {**mine, "wall_us": wall_us},
                        "skipped": dict(sum((Counter(s["skipped"]) for s in states), Counter())) if r == 0 else {},
                        "truncated": dict(sum((Counter(s.get("truncated", {})) for s in states), Counter()))
                        if r == 0 else {},
                        "sources": SourceTotals.merged([s.get("sources", {}) for s in states]) if r == 0 else {}})
        return out
