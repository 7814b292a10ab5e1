"""Versioned, plain-data state of a batcher (I6): JSON-able lists and ints, nothing else.

:func:`encode_state` writes a :class:`Snapshot` of a batcher with the world size, rank, settings,
dataset size and epochs it was taken with; :func:`decode_state` checks those against the loading
batcher (a difference raises ``ValueError`` naming what differs and what to do), then returns a
new :class:`Snapshot`, never touching its input. The layout (``STATE_VERSION`` 2), one flat object::

    version, world_size, rank, config, dataset_size, num_epochs   who took it, with what
    epoch, stream_pos, pending, epoch_of_shard                     the uid stream (odb.batching.stream)
    reader                                                         a streaming source's reader: pass, segments,
                                                                   buffer, draws (a streamed mixture: mixed,
                                                                   one such per source, and its epoch,
                                                                   repeats, counts, prior, sizes:
                                                                   odb.batching.stream_mixture); absent or
                                                                   null: none
    round_index, step_index, num_emitted, is_planned               progress (num_emitted: all ranks)
    bins, unpacked                                                 the window: [[uid, tokens, label_tokens,
                                                                   patches, cost], ...] per bin / unpacked
                                                                   (a pair: [..., cost, second], its
                                                                   rejected tokens: SampleCost)
    queue                                                          planned, untrained steps (encode_steps)
    observed, counts                                               [cost, cost^2, samples]; over-cap counts
    fit                                                            cost_model "fit": coefficients, window
                                                                   (odb.batching.fit); absent or null: none
    mixture                                                        a weighted data mixture: cursors, counts
                                                                   (odb.batching.mixture); absent or null: none

``is_planned``: every step of the run is planned, no round is left; the run itself is over only
once the queue is empty too (:func:`is_finished`). The last round of a run may plan several
steps, so a state taken between them has ``is_planned`` and a queue: resuming it trains the
queue. Version 1 called the same flag ``is_done`` (and odb then refused to resume such a state as
finished); it is read as version 2 (:func:`upgrade_state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from odb.batching.config import OdbConfig
from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, Shared, StepPlan

__all__ = ["STATE_VERSION", "Snapshot", "check_state", "decode_state", "decode_steps", "encode_state",
           "encode_steps", "is_finished", "upgrade_state"]

STATE_VERSION = 2  # version 1 (still read: upgrade_state) called ``is_planned`` ``is_done``

_STREAM_KEYS = ("epoch", "stream_pos", "pending", "epoch_of_shard", "reader")
RESUMABLE_CHANGES = ("cost_model",)
"""Settings a resume may change: how samples are priced (the loading batcher prices the window
again; a checkpoint written before the fit existed ran as ``"manual"`` does and resumes under
either). With ``global_batch_tokens`` also ``gas``, which the trainer derives from it for the
ranks at hand: it changes only with their number, and a re-deal plans the queued steps again."""


@dataclass
class Snapshot:
    """A batcher's state as objects: what :func:`encode_state` writes and :func:`decode_state` reads."""

    stream: dict[str, Any]  # odb.batching.stream.UidStream.state_dict()
    round_index: int
    step_index: int
    num_emitted: int  # samples trained over all ranks (the same on every rank)
    bins: list[list[SampleCost]]  # the packer's bins, in order
    unpacked: list[SampleCost]  # in the window, not in a bin yet
    queue: list[StepPlan]  # planned, not yet trained
    observed: tuple[int, int, int]  # admitted samples' cost, cost squared, count
    counts: dict[str, int]  # truncated (samples), truncated_tokens, dropped, skipped
    is_planned: bool  # every step of the run planned: no more rounds (the queue may still hold steps)
    fit: dict[str, Any] | None = None  # cost_model "fit": odb.batching.fit.CostFit.state_dict()
    mixture: dict[str, Any] | None = None  # a weighted mixture: odb.batching.mixture.Mixture.state_dict()


def encode_state(snapshot: Snapshot, *, world_size: int, rank: int, config: dict[str, Any], dataset_size: int,
                 num_epochs: int) -> dict[str, Any]:
    """The JSON-able state (the layout in the module docstring)."""
    s, stream = snapshot, snapshot.stream
    return {
        "version": STATE_VERSION, "world_size": world_size, "rank": rank, "config": dict(config),
        "dataset_size": dataset_size, "num_epochs": num_epochs, "epoch": stream["epoch"],
        "round_index": s.round_index, "step_index": s.step_index, "stream_pos": stream["stream_pos"],
        "num_emitted": s.num_emitted, "pending": list(stream["pending"]), "epoch_of_shard": stream["epoch_of_shard"],
        "reader": stream.get("reader"),
        "bins": [[_sample_row(sample) for sample in samples] for samples in s.bins],
        "unpacked": [_sample_row(sample) for sample in s.unpacked],
        "queue": encode_steps(s.queue), "observed": list(s.observed), "counts": dict(s.counts),
        "is_planned": s.is_planned, "fit": s.fit, "mixture": s.mixture,
    }


def upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in the current layout: a version-1 state gets ``is_planned`` for its ``is_done``
    (the same flag, renamed); a new dict, the input untouched. Anything else comes back as it is
    (:func:`check_state` judges it)."""
    if isinstance(state, dict) and state.get("version") == 1 and "is_done" in state:
        upgraded = {k: v for k, v in state.items() if k != "is_done"}
        return {**upgraded, "version": STATE_VERSION, "is_planned": state["is_done"]}
    return state


def is_finished(state: dict[str, Any]) -> bool:
    """Whether the run that wrote ``state`` (any readable version) was over: every step planned
    and trained, nothing queued. (Every rank queues the same steps, so one rank's state says it.)"""
    state = upgrade_state(state)
    return bool(state["is_planned"]) and not state["queue"]


def decode_state(state: dict[str, Any], *, world_size: int, rank: int, config: dict[str, Any],
                 dataset_size: int) -> Snapshot:
    """Checks ``state`` (:func:`check_state`) and decodes it into fresh objects.

    ``num_epochs`` is not checked: a resume may extend the run (the loading batcher's counts).
    A version-1 state is read as :func:`upgrade_state` makes it.
    """
    state = upgrade_state(state)
    check_state(state, world_size=world_size, rank=rank, config=config, dataset_size=dataset_size)
    return Snapshot(
        stream={key: list(state[key]) if key == "pending" else state.get(key) for key in _STREAM_KEYS},
        round_index=state["round_index"], step_index=state["step_index"], num_emitted=state["num_emitted"],
        bins=[[SampleCost(*row) for row in samples] for samples in state["bins"]],
        unpacked=[SampleCost(*row) for row in state["unpacked"]], queue=decode_steps(state["queue"]),
        observed=tuple(state["observed"]), counts=dict(state["counts"]), is_planned=state["is_planned"],
        fit=state.get("fit"), mixture=state.get("mixture"))


def check_state(state: dict[str, Any], *, world_size: int, rank: int, config: dict[str, Any],
                dataset_size: int) -> None:
    """Raises ``ValueError`` naming the fix when ``state`` cannot be loaded here."""
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError("not an odb batcher state (no 'version'); pass what state_dict() returned")
    state = upgrade_state(state)
    if state["version"] != STATE_VERSION:
        raise ValueError(f"odb batcher state version {state['version']} cannot be loaded by this odb "
                         f"(it reads versions 1 to {STATE_VERSION}); resume with the odb release that wrote it")
    if state["world_size"] != world_size:
        raise ValueError(f"state was taken with world_size={state['world_size']}, this run has "
                         f"{world_size}; deal every rank's state to this world size first with "
                         "odb.batching.redeal.redeal_states (launch/train.py --resume does)")
    if state["rank"] != rank:
        raise ValueError(f"state of rank {state['rank']} loaded on rank {rank}; load each rank's own file")
    if state["dataset_size"] != dataset_size:
        raise ValueError(f"state was taken on a dataset of {state['dataset_size']} samples, this one has "
                         f"{dataset_size}; resume on the same data")
    # A setting added after the state was written held its default then (e.g. pad_rows).
    saved = {**{k: v for k, v in _defaults().items() if k in config}, **state["config"]}
    resumable = RESUMABLE_CHANGES + (("gas",) if config.get("global_batch_tokens") is not None else ())
    differing = sorted(k for k in set(config) | set(saved)
                       if config.get(k) != saved.get(k) and k not in resumable)
    if differing:
        raise ValueError(f"odb settings differ from the checkpoint in {differing}; resume with the "
                         "settings the run started with")


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(OdbConfig)}


def _sample_row(sample: SampleCost) -> list[int]:
    """``[uid, tokens, label_tokens, patches, cost]``, and ``second`` after them for a pair (a
    sample of one sequence writes no 0 there: its rows read as before pairs had one)."""
    return list(sample) if sample.second else list(sample[:5])


def _micro_row(micro: MicroBatch) -> list:
    """``[padded, samples]``, and ``[owner, degree, tokens]`` after them for a shared micro-batch."""
    row = [int(micro.padded), [_sample_row(s) for s in micro.samples]]
    return row if micro.shared is None else [*row, list(micro.shared)]


def encode_steps(steps: Iterable[StepPlan]) -> list[dict[str, Any]]:
    """Step plans as JSON-able rows (also how the gloo tests send plans between processes)."""
    return [{"epoch": p.epoch, "step": p.step, "micro": [_micro_row(m) for m in p.micro_batches],
             "num_label_tokens": p.num_label_tokens, "num_samples": p.num_samples,
             "rank_costs": [list(c) for c in p.rank_costs], "rank_tokens": [list(t) for t in p.rank_tokens]}
            for p in steps]


def decode_steps(rows: list[dict[str, Any]]) -> list[StepPlan]:
    """The inverse of :func:`encode_steps`."""
    return [StepPlan(epoch=r["epoch"], step=r["step"],
                     micro_batches=tuple(MicroBatch(tuple(SampleCost(*s) for s in row[1]), bool(row[0]),
                                                    Shared(*row[2]) if len(row) > 2 else None)
                                         for row in r["micro"]),
                     num_label_tokens=r["num_label_tokens"], num_samples=r["num_samples"],
                     rank_costs=tuple(tuple(c) for c in r["rank_costs"]),
                     rank_tokens=tuple(tuple(t) for t in r["rank_tokens"])) for r in rows]
