"""Versioned, plain-data state of a batcher (I6): JSON-able lists and ints, nothing else.

A state records the world size, rank, settings and dataset size it was taken with; loading it
elsewhere raises ``ValueError`` naming what differs and what to do, and never mutates the input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from odb.batching.config import OdbConfig
from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, StepPlan

__all__ = ["STATE_VERSION", "check_state", "decode_steps", "encode_steps"]

STATE_VERSION = 1


def check_state(state: dict[str, Any], *, world_size: int, rank: int, config: dict[str, Any],
                dataset_size: int) -> None:
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError("not an odb batcher state (no 'version'); pass what state_dict() returned")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"odb batcher state version {state['version']} cannot be loaded by this odb "
                         f"(version {STATE_VERSION}); resume with the odb release that wrote it")
    if state["world_size"] != world_size:
        raise ValueError(f"state was taken with world_size={state['world_size']}, this run has "
                         f"{world_size}; resume with the same number of ranks")
    if state["rank"] != rank:
        raise ValueError(f"state of rank {state['rank']} loaded on rank {rank}; load each rank's own file")
    if state["dataset_size"] != dataset_size:
        raise ValueError(f"state was taken on a dataset of {state['dataset_size']} samples, this one has "
                         f"{dataset_size}; resume on the same data")
    # A setting added after the state was written held its default then (e.g. pad_rows).
    saved = {**{k: v for k, v in _defaults().items() if k in config}, **state["config"]}
    differing = sorted(k for k in set(config) | set(saved) if config.get(k) != saved.get(k))
    if differing:
        raise ValueError(f"odb settings differ from the checkpoint in {differing}; resume with the "
                         "settings the run started with")


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(OdbConfig)}


def _micro_row(micro: MicroBatch) -> list:
    return [int(micro.padded), [[s.uid, s.tokens, s.label_tokens, s.patches, s.cost] for s in micro.samples]]


def encode_steps(steps: Iterable[StepPlan]) -> list[dict[str, Any]]:
    return [{"epoch": p.epoch, "step": p.step, "micro": [_micro_row(m) for m in p.micro_batches],
             "num_label_tokens": p.num_label_tokens, "num_samples": p.num_samples, "rank_costs": [list(c) for c in p.rank_costs],
             "rank_tokens": [list(t) for t in p.rank_tokens]} for p in steps]


def decode_steps(rows: list[dict[str, Any]]) -> list[StepPlan]:
    return [StepPlan(epoch=r["epoch"], step=r["step"],
                     micro_batches=tuple(MicroBatch(tuple(SampleCost(*s) for s in samples), bool(padded))
                                         for padded, samples in r["micro"]),
                     num_label_tokens=r["num_label_tokens"], num_samples=r["num_samples"],
                     rank_costs=tuple(tuple(c) for c in r["rank_costs"]),
                     rank_tokens=tuple(tuple(t) for t in r["rank_tokens"])) for r in rows]
