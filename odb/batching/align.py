"""DGAP alignment: the one module that talks to other ranks.

Protocol (what callers must do):

1. Every rank builds a :class:`Communicator` over the same group and calls
   :meth:`Aligner.check_settings` once at start, with the same keys: one collective that fails
   on every rank, naming the keys that differ, if any rank was configured differently.
   A host's loop (:mod:`odb.integrations`) may then call :meth:`Aligner.largest` once, before
   the first round, on every rank: one collective, so that every rank plans the same step bound.
2. Every rank then calls :meth:`Aligner.round` in lockstep, once per round, *also after it has
   nothing left to train* (a finished rank keeps joining rounds until the round's decision says
   the epoch is done). Each round is exactly one ``all_gather_v`` of an int64 row: the round's
   vector (the same layout on every rank) with each array cut to the slots it uses
   (:meth:`odb.batching.wire.Layout.pack`), so rows differ in length.
3. A rank that must stop (bad data under strict, an over-cap error) still joins its next round
   and says so in its vector; every rank then raises (:class:`PeerStopped` on the others), so
   no rank is left waiting in a collective.
4. After the last round, :meth:`Aligner.gather_reports` may collect run totals (one collective).
   Nothing else in odb calls a collective. Model collectives (ZeRO) stay aligned because every
   rank receives the same number of steps and micro-batches per step from the decisions.

Two communicators implement the protocol: :class:`SimulatedGroup` (N ranks as threads of one
process, for tests and benchmarks) and :class:`TorchCommunicator` (torch.distributed on a
dedicated gloo CPU group, so that it never touches the NCCL stream of the model). The torch one
gathers by Bruck's algorithm (:func:`odb.batching.comm.bruck_steps`): ``ceil(log2 W)`` exchanges, each with one
peer, where gloo's own all_gather is a ring of ``W - 1`` hops (at 4,096 ranks, 12 latencies
instead of 4,095: two messages each, 24 latencies).

Sequence parallelism (:class:`SequenceGroups`): ``group_size`` consecutive processes hold one
packed row together, so to the protocol they are one rank. Each of them runs the same batcher on
the same uids (the group's index is its rank); every round still gathers every process's vector.
The aligner reads every process's ``is_fatal`` (a process that must stop stops every process),
checks that the processes of each group proposed the same bins (a group whose processes plan
differently would feed its ranks different rows: it stops the run), and folds the vectors to one
row per group, the group's first process's.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np

from odb.batching.comm import (
    Communicator,
    PeerStopped,
    SequenceGroups,
    SimulatedGroup,
    TorchCommunicator,
    as_matrix,
)
from odb.batching.decide import decide
from odb.batching.plan import Decision
from odb.batching.wire import Layout, Proposal, row_starts, segments

__all__ = ["Aligner", "Communicator", "PeerStopped", "SequenceGroups", "SettingsMismatch", "SimulatedGroup",
           "TorchCommunicator", "as_matrix"]


class SettingsMismatch(ValueError):
    """Ranks were started with different settings; the message names the keys."""


def _with_report(layout: Layout, room: int) -> Layout:
    """The round's layout: ``layout``, then a report of up to ``room`` values, sent as long as it is."""
    return layout.then(Layout(scalars=("report_len",), arrays={"report": room}, lengths={"report": "report_len"}))


def _fingerprint(value: Any) -> int:
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


class Aligner:
    """Runs DGAP rounds over a communicator; see the module docstring for the protocol."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.group_size = getattr(comm, "group_size", 1)  # processes per rank (SequenceGroups)
        self.collective_s = 0.0  # time spent inside collectives (waiting for the other ranks)
        self.reports = np.zeros((comm.world_size, 0), dtype=np.int64)  # the last round's telemetry
        self.extra: dict[str, np.ndarray] = {}  # the last round's extra fields, every rank's

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def check_settings(self, settings: dict[str, Any]) -> None:
        """One collective at start: raise :class:`SettingsMismatch` on every rank if any key differs.

        Every rank must pass the same keys (in any order); values are compared by fingerprint.
        """
        keys = sorted(settings)
        mine = np.array([_fingerprint([len(keys)] + keys)] + [_fingerprint([k, settings[k]]) for k in keys],
                        dtype=np.int64)
        rows, lengths = self.comm.all_gather_v(mine)
        if len(set(lengths.tolist())) > 1:
            raise SettingsMismatch("ranks run different odb versions or builds (they check different numbers of "
                                   "settings); install the same odb on every node")
        gathered = as_matrix(rows, lengths)
        if len(set(gathered[:, 0].tolist())) > 1:
            raise SettingsMismatch("ranks run different odb versions or builds (they check different settings); "
                                   "install the same odb on every node")
        differing = {k: np.flatnonzero(gathered[:, i + 1] != gathered[0, i + 1]).tolist()
                     for i, k in enumerate(keys)}
        differing = {k: ranks for k, ranks in differing.items() if ranks}
        if differing:
            raise SettingsMismatch(
                "ranks were started with different settings: "
                + "; ".join(f"{k!r}: rank(s) {ranks} differ from rank 0" for k, ranks in differing.items())
                + f" (rank {self.rank} has " + ", ".join(f"{k}={settings[k]!r}" for k in differing)
                + "); start every rank with the same config files, flags, data, model and odb version")

    def largest(self, value: int) -> int:
        """The largest of every rank's ``value`` (one collective, on every rank before the first
        round): a bound that every rank then holds alike."""
        return int(self.comm.all_gather(np.asarray([value], dtype=np.int64)).max())

    def gather_reports(self, values: np.ndarray, *, ragged: bool = False) -> np.ndarray:
        """Every rank's run report ``[world, len]``: the one collective after the last round (a
        sequence-parallel group's: its first process's, which holds the group's figures). Rows of
        different lengths raise, unless ``ragged`` (packed rows, :meth:`odb.batching.wire.Layout.pack`:
        the shorter zero-padded)."""
        rows, lengths = self.comm.all_gather_v(np.asarray(values, dtype=np.int64))
        if not ragged:
            return as_matrix(rows, lengths)[::self.group_size]
        return segments(rows, row_starts(lengths), lengths)[::self.group_size]

    def round(self, proposal: Proposal, *, max_bins: int, max_samples: int, report: np.ndarray | None = None,
              extra: tuple[Layout, dict[str, Any]] | None = None, **decide_args: Any) -> Decision:
        """One round: exactly one all_gather_v, then the pure decision (same on every rank).

        The vector is the proposal (:func:`odb.batching.wire.proposal_layout` with ``max_bins`` and
        ``max_samples`` slots), then ``extra`` (a layout and this rank's values: the cost fit's
        observations, :mod:`odb.batching.fit`), then ``report`` (as long as it is: a telemetry
        report of another length than its peers' fails the telemetry's check): telemetry figures
        that need no collective of their own. Each travels cut to what it uses
        (:meth:`odb.batching.wire.Layout.pack`). Every rank's report comes back in :attr:`reports`
        ``[world, len]``, and every rank's ``extra`` fields in :attr:`extra` (arrays as wide as the
        most slots a rank used).
        """
        report = np.zeros(0, dtype=np.int64) if report is None else report
        layout, values = proposal.layout(max_bins, max_samples), proposal.values()
        if extra is not None:
            layout, values = layout.then(extra[0]), {**values, **extra[1]}
        sent = _with_report(layout, len(report))
        row = sent.pack(sent.encode(**values, report=report, report_len=len(report)))
        start = time.perf_counter()
        rows, lengths = self.comm.all_gather_v(row)
        self.collective_s += time.perf_counter() - start
        try:  # (room for any rank's report: ranks whose reports differ fail the telemetry's check)
            fields = _with_report(layout, 1 << 40).unpack(rows, lengths)
        except ValueError as err:
            raise SettingsMismatch(str(err)) from None
        fields.pop("report_len")
        size = self.group_size  # (sequence parallelism: a group's first process's rows)
        self.reports = fields.pop("report")[::size]  # (also for a failed round: its steps still get written)
        self.extra = {name: fields.pop(name)[::size] for name in (extra[0].names if extra is not None else ())}
        failed = np.flatnonzero(fields["is_fatal"]).tolist()  # (every process's)
        if failed:
            raise PeerStopped(f"rank(s) {failed} stopped the run; their error names the cause")
        if size > 1:
            fields = self._fold(fields)
        return decide(fields, **decide_args)

    def _fold(self, fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every process's proposal -> one row per sequence-parallel group (its first process's). The
        group's processes must have proposed the same (their timings, in ``extra`` and ``report``,
        may differ)."""
        size = self.group_size
        for name in fields:
            values = fields[name].reshape(len(fields[name]) // size, size, *fields[name].shape[1:])
            if not (values == values[:, :1]).all():
                groups = np.flatnonzero((values != values[:, :1]).reshape(len(values), -1).any(axis=1)).tolist()
                raise RuntimeError(f"the ranks of sequence-parallel group(s) {groups} proposed different {name}: "
                                   "they fetched different samples or sizes, and would train different rows; "
                                   "their data processing must be deterministic (same data, seed and settings)")
        return {name: value[::size] for name, value in fields.items()}
