"""Per-source figures of a data mixture (:class:`odb.data.mixture.MixedDataset`: several named
sources, each sample carrying its source's index): the loss of each source over log intervals in
``metrics.jsonl``, and each source's trained samples and label tokens over the run in
``summary.json``. A single-source dataset has neither in its rows; its summary has one entry.

Loss per source. Each rank adds up, per source, its steps' summed token loss and label tokens
(:class:`odb.training.step.objective.StepResult`, split from the very token losses the steps backed) over
intervals of ``every`` steps (``--log_steps``): an interval ends at each step ``s`` with
``(s + 1) % every == 0``. A closed interval rides on the next round's report, with no collective of
its own: per source its loss sum as the bits of a float64 and its label tokens, ``2 S`` int64 per
interval (:meth:`SourceIntervals.layout`). Rank 0 adds the ranks' sums (``math.fsum``: exactly
rounded) and writes, on the row of the interval's last step::

    loss/<source>          sum over ranks and the interval's steps of the source's token losses
                           / label_tokens/<source>   (null where that is 0)
    label_tokens/<source>  the source's label tokens over ranks and the interval's steps

So ``loss/<source>`` is a per-token mean over the interval, as ``loss`` is over its step; the label
tokens weigh it. A preference objective's steps train the mean over their pairs
(:mod:`odb.training.step.preference`): there the sums are of the source's pair losses and the
pairs weigh them, ``pairs/<source>`` in place of ``label_tokens/<source>`` (the run totals in
``summary.json`` still count the pairs as ``samples`` and their label tokens). Every step is in
exactly one interval:

* the run's last interval ends at its last step, whole or not (:meth:`SourceIntervals.close`: at
  the run's end, at a stop on request, after ``--max_steps``), before the checkpoint of that step,
  so a resume from it starts a new interval, which ends at the next multiple of ``every``;
* a checkpoint saved inside an interval (``--save_steps``) holds each rank's open interval
  (:meth:`SourceIntervals.state_dict`): a resume from it (after a crash, the rows past the
  checkpoint superseded: :mod:`odb.telemetry.writer`) goes on adding to it, so the row that
  closes it is the uninterrupted run's.

The row of an interval is its last step's; where that row was written before the interval was
known to be the last (a run whose last round planned no step), the interval's figures are a row
of their own, ``{"step", "loss/<source>", "label_tokens/<source>", "time"}``.

Run totals per source: each rank counts its samples and label tokens per source (kept across
resumes, by source name, in the checkpoint's run state); the run's one final gather sums them
(:meth:`SourceTotals.layout`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from odb.batching.wire import Layout

__all__ = ["SourceIntervals", "SourceTotals", "source_keys", "sources_summary"]


@dataclass
class _Interval:
    last_step: int
    loss: list[float]
    label_tokens: list[int]


def _padded(values: Sequence[Any], size: int, zero: Any) -> list[Any]:
    """``values`` (per source id, as far as the largest seen) over all ``size`` sources."""
    if len(values) > size:
        raise ValueError(f"a sample's source id {len(values) - 1} is outside the dataset's {size} sources")
    return [*values, *[zero] * (size - len(values))]


def source_keys(names: Sequence[str], loss: Sequence[float], label_tokens: Sequence[int], *,
                unit: str = "label_tokens") -> dict[str, Any]:
    """``loss/<name>`` (the summed loss / the label tokens, None where there are none) and
    ``label_tokens/<name>`` of every source (``unit`` 'pairs': what the counts are, a preference
    objective's pairs, as ``pairs/<name>``)."""
    out: dict[str, Any] = {f"loss/{name}": round(total / tokens, 6) if tokens else None
                           for name, total, tokens in zip(names, loss, label_tokens)}
    out.update({f"{unit}/{name}": int(tokens) for name, tokens in zip(names, label_tokens)})
    return out


class SourceIntervals:
    """One rank's per-source loss sums and label tokens over log intervals, on their way to rank 0's
    rows (the module docstring).

    Args:
        names: the dataset's ``source_names``; one name: nothing is kept, nothing travels.
        every: steps per interval (at least 1).
        max_steps: the most steps one report carries (so the most intervals it can close).
    """

    def __init__(self, names: Sequence[str], *, every: int, max_steps: int) -> None:
        self.names = tuple(names)
        self.every = max(1, every)
        # intervals closed among max_steps consecutive steps: ceil(max_steps / every) at most, + the last one
        self.slots = max_steps // self.every + 2
        self.open: _Interval | None = None
        self.pending: list[_Interval] = []  # closed, not yet reported
        self.reported: list[_Interval] = []  # reported, not yet gathered
        self.unit = "label_tokens"  # what the counts are: 'pairs' for a preference objective (record)

    @property
    def active(self) -> bool:
        """Several sources: their figures are kept and reported."""
        return len(self.names) > 1

    def layout(self) -> Layout:
        """This rank's part of its round report (empty for one source)."""
        if not self.active:
            return Layout()
        size = self.slots * len(self.names)
        return Layout(scalars=("source_intervals", "source_values"),
                      arrays={"source_loss_bits": size, "source_label_tokens": size},
                      lengths={"source_loss_bits": "source_values", "source_label_tokens": "source_values"})

    def record(self, step: int, loss: Sequence[float], label_tokens: Sequence[int], *, pairs: bool = False) -> None:
        """This rank trained ``step`` (in order): its summed token loss and label tokens per source id
        (``pairs``: a preference objective's summed pair losses and pairs)."""
        if not self.active:
            return
        self.unit = "pairs" if pairs else "label_tokens"
        size = len(self.names)
        if self.open is None:
            self.open = _Interval(step, [0.0] * size, [0] * size)
        for s, (total, tokens) in enumerate(zip(_padded(loss, size, 0.0), _padded(label_tokens, size, 0))):
            self.open.loss[s] += total
            self.open.label_tokens[s] += tokens
        self.open.last_step = step
        if (step + 1) % self.every == 0:
            self.pending.append(self.open)
            self.open = None

    def close(self) -> bool:
        """The run's last interval ends here, at its last step so far (the run's end, a stop, on
        every rank alike): it rides on the next report as a closed one. Returns whether one was open."""
        if self.open is None:
            return False
        self.pending.append(self.open)
        self.open = None
        return True

    def state_dict(self) -> dict[str, Any] | None:
        """The open interval, for a checkpoint (JSON-able, sums by source name): a resume goes on
        adding to it. None when none is open (the checkpoint's step ends an interval)."""
        if self.open is None:
            return None
        return {"last_step": self.open.last_step, "loss": dict(zip(self.names, self.open.loss)),
                "label_tokens": dict(zip(self.names, self.open.label_tokens)), "unit": self.unit}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Reopens a checkpoint's open interval (:meth:`state_dict`; a source this run no longer has
        is left out of it); None: a new interval starts at the next step."""
        if not self.active or state is None:
            return
        self.open = _Interval(state["last_step"], [float(state["loss"].get(name, 0.0)) for name in self.names],
                              [int(state["label_tokens"].get(name, 0)) for name in self.names])
        self.unit = state.get("unit", "label_tokens")  # (what its counts are: a stop right after the resume)

    @staticmethod
    def redealt(states: Sequence[Mapping[str, Any] | None], world_size: int) -> list[dict[str, Any] | None]:
        """Several ranks' :meth:`state_dict` as ``world_size`` new ranks' (a resume on another number
        of ranks): the sums on new rank 0, an empty interval of the same steps on the others (every
        rank closes the same intervals)."""
        first = next((state for state in states if state is not None), None)
        if first is None:
            return [None] * world_size
        loss: dict[str, list[float]] = {}
        tokens: dict[str, int] = {}
        for state in states:
            for name, value in (state or {}).get("loss", {}).items():
                loss.setdefault(name, []).append(value)
            for name, value in (state or {}).get("label_tokens", {}).items():
                tokens[name] = tokens.get(name, 0) + value
        unit = first.get("unit", "label_tokens")
        merged = {"last_step": first["last_step"], "loss": {name: math.fsum(v) for name, v in loss.items()},
                  "label_tokens": tokens, "unit": unit}
        empty = {"last_step": first["last_step"], "loss": dict.fromkeys(loss, 0.0),
                 "label_tokens": dict.fromkeys(tokens, 0), "unit": unit}
        return [merged if r == 0 else empty for r in range(world_size)]

    def fields(self) -> dict[str, Any]:
        """The report's fields: the intervals closed since the last report, which become the reported ones."""
        if not self.active:
            return {}
        assert len(self.pending) <= self.slots, "more log intervals between rounds than a report holds"
        self.reported, self.pending = self.pending, []
        loss = np.array([i.loss for i in self.reported], dtype=np.float64).ravel()
        return {"source_intervals": len(self.reported), "source_values": len(loss),
                "source_loss_bits": loss.view(np.int64),
                "source_label_tokens": [t for i in self.reported for t in i.label_tokens]}

    def complete(self, fields: Mapping[str, np.ndarray]) -> dict[int, dict[str, Any]]:
        """Every rank's gathered report fields: per reported interval, the keys of its last step's
        row (:func:`source_keys`, summed over the ranks); the reported intervals are forgotten."""
        if not self.active:
            return {}
        reported, self.reported = self.reported, []
        assert (fields["source_intervals"] == len(reported)).all(), "ranks closed different log intervals"
        world, count, size = len(fields["source_intervals"]), len(reported), len(self.names)
        bits = np.ascontiguousarray(fields["source_loss_bits"][:, :count * size])
        loss = bits.view(np.float64).reshape(world, count, size)
        tokens = fields["source_label_tokens"][:, :count * size].reshape(world, count, size)
        rows = {}
        for i, interval in enumerate(reported):
            sums = [math.fsum(loss[:, i, s].tolist()) for s in range(size)]
            rows[interval.last_step] = source_keys(self.names, sums, tokens[:, i].sum(axis=0).tolist(), unit=self.unit)
        return rows


class SourceTotals:
    """One rank's samples and label tokens per source over the whole run (resumes included, by
    source name: a source that a resumed run no longer has is left out of its summary)."""

    def __init__(self, names: Sequence[str] = ("data",)) -> None:
        self.counts: dict[str, list[int]] = {}  # name: [samples, label tokens]
        self.names = tuple(names)

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @names.setter
    def names(self, names: Sequence[str]) -> None:
        self._names = tuple(names)
        for name in self._names:
            self.counts.setdefault(name, [0, 0])

    def record(self, samples: Sequence[int], label_tokens: Sequence[int]) -> None:
        """A step's samples and label tokens per source id, on this rank."""
        size = len(self.names)
        for s, (n, t) in enumerate(zip(_padded(samples, size, 0), _padded(label_tokens, size, 0))):
            self.counts[self.names[s]][0] += n
            self.counts[self.names[s]][1] += t

    def layout(self) -> Layout:
        """This rank's part of the final gather (empty for one source: the run totals say it all)."""
        size = len(self.names)
        return Layout(arrays={"run_source_samples": size, "run_source_label_tokens": size}) if size > 1 else Layout()

    def fields(self) -> dict[str, list[int]]:
        if len(self.names) == 1:
            return {}
        return {"run_source_samples": [self.counts[n][0] for n in self.names],
                "run_source_label_tokens": [self.counts[n][1] for n in self.names]}

    def state_dict(self) -> dict[str, list[int]]:
        return {name: list(counts) for name, counts in self.counts.items()}

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        self.counts = {name: list(counts) for name, counts in state.items()}
        self.names = self.names

    @staticmethod
    def merged(states: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, list[int]]:
        """Several ranks' :meth:`state_dict` added up (a resume on another number of ranks)."""
        out: dict[str, list[int]] = {}
        for state in states:
            for name, (samples, tokens) in state.items():
                counts = out.setdefault(name, [0, 0])
                counts[0] += samples
                counts[1] += tokens
        return out


def sources_summary(names: Sequence[str], samples: Sequence[int], label_tokens: Sequence[int]) -> dict[str, Any]:
    """``summary.json``'s ``sources``: per name its trained ``samples``, ``label_tokens`` and
    ``share`` (of the run's label tokens; null when none was trained)."""
    total = sum(label_tokens)
    return {name: {"samples": int(n), "label_tokens": int(t), "share": round(t / total, 6) if total else None}
            for name, n, t in zip(names, samples, label_tokens)}
