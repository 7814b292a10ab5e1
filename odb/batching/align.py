"""DGAP alignment: the one module that talks to other ranks.

Protocol (what callers must do):

1. Every rank builds a :class:`Communicator` over the same group and calls
   :meth:`Aligner.check_settings` once at start, with the same keys: one collective that fails
   on every rank, naming the keys that differ, if any rank was configured differently.
   A host's loop (:mod:`odb.integrations`) may then call :meth:`Aligner.largest` once, before
   the first round, on every rank: one collective, so that every rank plans the same step bound.
2. Every rank then calls :meth:`Aligner.round` in lockstep, once per round, *also after it has
   nothing left to train* (a finished rank keeps joining rounds until the round's decision says
   the epoch is done). Each round is exactly one ``all_gather`` of a fixed-size int64 vector.
3. A rank that must stop (bad data under strict, an over-cap error) still joins its next round
   and says so in its vector; every rank then raises (:class:`PeerStopped` on the others), so
   no rank is left waiting in a collective.
4. After the last round, :meth:`Aligner.gather_reports` may collect run totals (one collective).
   Nothing else in odb calls a collective. Model collectives (ZeRO) stay aligned because every
   rank receives the same number of steps and micro-batches per step from the decisions.

Two communicators implement the protocol: :class:`SimulatedGroup` (N ranks as threads of one
process, for tests and benchmarks) and :class:`TorchCommunicator` (torch.distributed on a
dedicated gloo CPU group, so that it never touches the NCCL stream of the model).

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
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import numpy as np

from odb.batching.decide import decide
from odb.batching.plan import Decision
from odb.batching.wire import Layout, Proposal

__all__ = ["Aligner", "Communicator", "PeerStopped", "SequenceGroups", "SettingsMismatch", "SimulatedGroup",
           "TorchCommunicator"]


T = TypeVar("T")


class PeerStopped(RuntimeError):
    """Another rank stopped the run (its own log and error say why)."""


class SettingsMismatch(ValueError):
    """Ranks were started with different settings; the message names the keys."""


class Communicator(Protocol):
    """The only collective odb needs: gather one int64 vector of the same length from each rank."""

    rank: int
    world_size: int
    num_collectives: int

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        """Returns ``[world_size, len(values)]``; row r is rank r's ``values`` (a
        :class:`SequenceGroups`: ``[world_size * group_size, len]``, every process's)."""
        ...


class SimulatedGroup:
    """N ranks in one process: :meth:`run` runs each rank in its own thread with its own
    communicator.

    ``all_gather`` blocks until every rank has contributed (a barrier), so a rank that skips or
    repeats a collective shows up as a timeout, as it would as a hang on a real cluster. Under
    :meth:`run` one rank computes at a time (it hands over while waiting in a collective), so
    ranks do not fight over the GIL and timings read like the ranks' own work.
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        # Double-buffered by collective parity: a rank can be at most one collective ahead.
        self._slots: list[list[np.ndarray | None]] = [[None] * world_size, [None] * world_size]
        self._results: list[np.ndarray | None] = [None, None]
        self._count = [0] * world_size  # collectives called, per rank
        self._done = 0  # collectives completed
        self._error = ""
        self._barrier = threading.Barrier(world_size, action=self._stack, timeout=timeout_s)
        self._baton = threading.Lock()
        self._holds_baton = [False] * world_size

    def communicator(self, rank: int) -> _SimulatedCommunicator:
        return _SimulatedCommunicator(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    def run(self, fn: Callable[[Communicator], T]) -> list[T]:
        """Runs ``fn(communicator)`` for every rank; returns the results, re-raises a failure."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                with self._baton:
                    self._holds_baton[rank] = True
                    results[rank] = fn(self.communicator(rank))
            except BaseException as err:  # noqa: BLE001 - handed to the caller below
                errors.append(err)
                self.abort()

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.world_size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            self.abort()
            raise TimeoutError(f"simulated ranks did not finish within {self.timeout_s} s (a hang)")
        if errors:
            real = [e for e in errors if not isinstance(e, (threading.BrokenBarrierError, PeerStopped))]
            raise (real or errors)[0]
        return results

    def _stack(self) -> None:
        parity = self._done % 2
        self._done += 1
        lengths = sorted({len(v) for v in self._slots[parity]})
        if len(lengths) != 1:
            self._error = f"all_gather with different lengths across ranks: {lengths}"
            raise RuntimeError(self._error)
        self._results[parity] = np.stack(self._slots[parity])

    def gather(self, rank: int, values: np.ndarray) -> np.ndarray:
        index = self._count[rank]
        parity = index % 2
        self._count[rank] += 1
        self._slots[parity][rank] = np.array(values, dtype=np.int64)
        if self._holds_baton[rank]:
            self._baton.release()
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            # An abort can reach a rank that the completed collective already released; only a
            # collective that never completed is broken.
            if self._done <= index:
                if self._error:
                    raise RuntimeError(self._error) from None
                raise
        finally:
            if self._holds_baton[rank]:
                self._baton.acquire()
        return self._results[parity]


class _SimulatedCommunicator:
    def __init__(self, group: SimulatedGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.num_collectives = 0

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        self.num_collectives += 1
        return self.group.gather(self.rank, values)


class TorchCommunicator:
    """torch.distributed on a dedicated gloo group (CPU tensors; safe beside an NCCL model group).

    Create it on every rank after ``init_process_group`` (creating the group is itself collective).
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist  # the only torch.distributed import in odb's core

        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed initialised first "
                               "(deepspeed.init_distributed() or init_process_group())")
        self._dist = dist
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.num_collectives = 0

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        import torch

        self.num_collectives += 1
        local = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self._dist.all_gather(parts, local, group=self.group)
        return torch.stack(parts).numpy()


class SequenceGroups:
    """``comm``'s processes as ranks of ``group_size`` consecutive processes each (sequence
    parallelism: the module docstring). ``rank`` is the group's index, ``world_size`` the number of
    groups; :meth:`all_gather` returns every process's row, for :class:`Aligner` to fold."""

    def __init__(self, comm: Communicator, group_size: int) -> None:
        if group_size < 1 or comm.world_size % group_size:
            raise ValueError(f"sequence_parallel_size {group_size} must divide the {comm.world_size} ranks")
        self.comm, self.group_size = comm, group_size
        self.rank, self.world_size = comm.rank // group_size, comm.world_size // group_size

    @property
    def num_collectives(self) -> int:
        return self.comm.num_collectives

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        return self.comm.all_gather(values)


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
        gathered = self.comm.all_gather(mine)
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

    def gather_reports(self, values: np.ndarray) -> np.ndarray:
        """Every rank's run report ``[world, len]``: the one collective after the last round (a
        sequence-parallel group's: its first process's, which holds the group's figures)."""
        return self.comm.all_gather(np.asarray(values, dtype=np.int64))[::self.group_size]

    def round(self, proposal: Proposal, *, max_bins: int, max_samples: int, report: np.ndarray | None = None,
              extra: tuple[Layout, dict[str, Any]] | None = None, **decide_args: Any) -> Decision:
        """One round: exactly one all_gather, then the pure decision (same on every rank).

        The vector is the proposal (:func:`odb.batching.wire.proposal_layout` with ``max_bins`` and
        ``max_samples`` slots), then ``extra`` (a layout and this rank's values: the cost fit's
        observations, :mod:`odb.batching.fit`), then ``report`` (the same length on every rank):
        telemetry figures that need no collective of their own. Every rank's comes back in
        :attr:`reports` ``[world, len]``, and every rank's ``extra`` fields in :attr:`extra`.
        """
        report = np.zeros(0, dtype=np.int64) if report is None else report
        layout, values = proposal.layout(max_bins, max_samples), proposal.values()
        if extra is not None:
            layout, values = layout.then(extra[0]), {**values, **extra[1]}
        layout = layout.then(Layout(arrays={"report": len(report)}))
        payload = layout.encode(**values, report=report)
        start = time.perf_counter()
        gathered = self.comm.all_gather(payload)
        self.collective_s += time.perf_counter() - start
        fields = layout.decode(gathered)
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
            values = fields[name].reshape(-1, size, *fields[name].shape[1:])
            if not (values == values[:, :1]).all():
                groups = np.flatnonzero((values != values[:, :1]).reshape(len(values), -1).any(axis=1)).tolist()
                raise RuntimeError(f"the ranks of sequence-parallel group(s) {groups} proposed different {name}: "
                                   "they fetched different samples or sizes, and would train different rows; "
                                   "their data processing must be deterministic (same data, seed and settings)")
        return {name: value[::size] for name, value in fields.items()}
