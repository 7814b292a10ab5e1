"""The communicators of the round protocol (:mod:`odb.batching.align`): the one collective odb
needs, over N simulated ranks (threads of one process) or torch.distributed's gloo.

:class:`TorchCommunicator` gathers by Bruck's algorithm (:func:`bruck_steps`): ``ceil(log2 W)``
exchanges, each with one peer, where gloo's own all_gather is a ring of ``W - 1`` hops (at 4,096
ranks 12 exchanges of two messages each, 24 latencies, instead of 4,095; the bytes received are
the same).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = ["Communicator", "PeerStopped", "SequenceGroups", "SimulatedGroup", "TorchCommunicator", "as_matrix",
           "bruck_steps"]

T = TypeVar("T")


class PeerStopped(RuntimeError):
    """Another rank stopped the run (its own log and error say why)."""


class Communicator(Protocol):
    """The only collective odb needs: gather one int64 vector from each rank (:meth:`all_gather_v`:
    of any length; :meth:`all_gather`: of the same length, as a matrix)."""

    rank: int
    world_size: int
    num_collectives: int

    def all_gather_v(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns every rank's ``values`` end to end in rank order, and each one's length (a
        :class:`SequenceGroups`: every process's)."""
        ...

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        """Returns ``[world_size, len(values)]``; row r is rank r's ``values`` (a
        :class:`SequenceGroups`: ``[world_size * group_size, len]``, every process's)."""
        ...


def as_matrix(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """:meth:`Communicator.all_gather_v`'s result as ``[world, len]``; raises where lengths differ."""
    if len(set(lengths.tolist())) > 1:
        raise RuntimeError(f"all_gather with different lengths across ranks: {sorted(set(lengths.tolist()))}")
    return rows.reshape(len(lengths), -1)


def bruck_steps(rank: int, world: int) -> list[tuple[int, int, int]]:
    """Bruck's all_gather from ``rank``'s side: per exchange ``(to, from, count)``. Before an
    exchange a rank holds the rows of ranks ``rank, rank + 1, ...`` (mod ``world``), ``have`` of
    them; it sends its first ``count = min(have, world - have)`` to ``rank - have`` and receives as
    many from ``rank + have``, which follow its own: ``ceil(log2 world)`` exchanges in all."""
    steps, have = [], 1
    while have < world:
        count = min(have, world - have)
        steps.append(((rank - have) % world, (rank + have) % world, count))
        have += count
    return steps


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
        rows = self._slots[parity]
        self._results[parity] = (np.concatenate(rows), np.array([len(v) for v in rows], dtype=np.int64))

    def gather(self, rank: int, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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

    def all_gather_v(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.num_collectives += 1
        return self.group.gather(self.rank, values)

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        return as_matrix(*self.all_gather_v(values))


class TorchCommunicator:
    """torch.distributed on a dedicated gloo group (CPU tensors; safe beside an NCCL model group).

    Create it on every rank after ``init_process_group`` (creating the group is itself collective).
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist  # the only torch.distributed import in odb's core

        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed initialised first "
                               "(deepspeed.init_distributed() or init_process_group())")
        self._dist, self.timeout = dist, timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.num_collectives = 0
        self._steps = [(dist.get_global_rank(self.group, to), dist.get_global_rank(self.group, frm), count)
                       for to, frm, count in bruck_steps(self.rank, self.world_size)]

    def all_gather_v(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bruck's algorithm (:func:`bruck_steps`) over the gloo group's point-to-point sends: per
        exchange the rows' lengths, then the rows."""
        self.num_collectives += 1
        lengths = [len(values)]
        held = np.ascontiguousarray(values, dtype=np.int64)
        for to, frm, count in self._steps:
            got = self._exchange(np.array(lengths[:count], dtype=np.int64), to, frm, count)
            rows = self._exchange(held[:sum(lengths[:count])], to, frm, int(got.sum()))
            lengths += got.tolist()
            held = np.concatenate([held, rows])
        # held: ranks rank, rank + 1, ... (mod world); in rank order from rank 0's row on
        first = self.world_size - self.rank  # rows before rank 0's
        at = sum(lengths[:first])
        return np.concatenate([held[at:], held[:at]]), np.array(lengths[first:] + lengths[:first], dtype=np.int64)

    def _exchange(self, send: np.ndarray, to: int, frm: int, count: int) -> np.ndarray:
        """Sends ``send`` to ``to`` while receiving ``count`` values from ``frm`` (sizes both sides
        know: nothing travels for 0)."""
        import torch

        received = torch.empty(count, dtype=torch.int64)
        sent = self._dist.isend(torch.from_numpy(np.ascontiguousarray(send)), to, group=self.group) \
            if len(send) else None
        if count:
            self._dist.irecv(received, frm, group=self.group).wait(self.timeout)
        if sent is not None:
            sent.wait(self.timeout)
        return received.numpy()

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        return as_matrix(*self.all_gather_v(values))


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

    def all_gather_v(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.comm.all_gather_v(values)

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        return self.comm.all_gather(values)
