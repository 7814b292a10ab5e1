"""What a run does when a rank dies or freezes: no hang, the rank named.

The watchdog and the graceful stop (:mod:`odb.training.run.stop`) both ride on the rendezvous
store (the TCP key-value store every launcher starts at ``MASTER_ADDR:MASTER_PORT``), never on
the model's collectives, so that they work when the model's collectives are the thing that hangs
and when no launcher can see the failed process (a rank on another node):

:class:`Watchdog` (one per rank, two daemon threads). The I/O thread writes this rank's heartbeat
every ``interval`` (a counter, where the rank is, how long it has made no progress, whether it is
waiting on its peers), reads the heartbeat of the next rank in a ring, and reads the abort key.
The judge thread reads only local state, so it runs even when the store does not answer::

    fault                                   seen by                       after
    a peer's heartbeat stops (SIGKILL,      the rank watching it (ring)   timeout
      SIGSTOP, a dead node)
    the store does not answer (its host,    every rank                    timeout
      rank 0's process, froze or died)
    this rank makes no progress while it    this rank                     timeout + slack
      is not waiting on peers (a stuck
      DataLoader worker, a dead NFS mount)
    this rank waits on its peers that long  this rank                     timeout + 2 slack
      (a collective that never completes)

Whoever sees a fault first logs it (which rank, at which step and round, doing what), writes it
to the abort key and ends its process with :data:`EXIT_STALLED`; every other rank reads the key
within ``interval`` and does the same. The slacks order the reports so that the most precise
one comes first (a silent rank before the peers that wait on it). ``timeout`` is
``--dist_timeout_s``; the process group's own collective timeouts are set longer
(:func:`collective_timeout_s`), as a backstop.

Its keys are this attempt's (:func:`odb.training.backends.process_group.connect_store`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from odb.batching.comm import as_matrix
from odb.training.backends.process_group import intervals
from odb.training.run.stop import Preempted

__all__ = ["EXIT_STALLED", "Watchdog", "WatchedCommunicator"]

EXIT_STALLED = 71
"""Exit code of every rank of a run that a frozen, dead or stuck rank stopped (the watchdog)."""


_PREFIX = "odb/"


_ABORT = _PREFIX + "abort"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _store_address() -> str:
    return f"the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def _within(seconds: float, read: Callable[[], str]) -> str | None:
    """``read()`` in a daemon thread, given ``seconds``: its result, or None if it did not return
    (a store call to a frozen host blocks past its own timeout)."""
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(read()), daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


class Watchdog:
    """One rank's watchdog (the module docstring has the protocol).

    Args:
        store: a store client used only by this watchdog's I/O thread (:func:`connect_store`).
        rank, world_size: this rank, and the ranks of the run.
        timeout_s: how long a rank may go without a heartbeat, or without progress.
        on_exit: called just before the process ends (local, quick: e.g. removing shared memory).
        exit: how the process ends (``os._exit``: the main thread may be stuck in C++).
    """

    def __init__(self, store, *, rank: int, world_size: int, timeout_s: float,
                 on_exit: Callable[[], None] = lambda: None, exit: Callable[[int], None] = os._exit) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.interval, self.slack = intervals(timeout_s)
        self.on_exit, self._exit = on_exit, exit
        self.where, self.step, self.round = "starting", 0, 0
        self.is_waiting = False
        self.is_armed = False  # progress is watched from the first step on (loading a model may take long)
        self._progress_at = time.monotonic()
        self._io_at = time.monotonic()  # the last completed I/O cycle
        self._seq = 0
        self._peer = (rank + 1) % world_size
        self._peer_seen: tuple[int, float, dict[str, Any]] | None = None  # seq, when it changed, record
        self._abort: dict[str, Any] | None = None  # the first abort read, and when (``seen_at``)
        self._failed = False
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._io_loop, name="odb-watchdog-io", daemon=True),
                         threading.Thread(target=self._judge_loop, name="odb-watchdog", daemon=True)]

    # ---- the main thread's side ---------------------------------------------------------------

    def start(self) -> Watchdog:
        for thread in self._threads:
            thread.start()
        return self

    def progress(self, where: str, *, step: int | None = None, round: int | None = None,
                 waiting: bool = False) -> None:
        """The rank moved on: it is now doing ``where`` (``waiting``: on its peers)."""
        self.where, self.is_waiting = where, waiting
        if step is not None:
            self.step = step
        if round is not None:
            self.round = round
        self._progress_at = time.monotonic()

    def arm(self) -> None:
        """Watch progress from now on (the train loop starts)."""
        self.progress("training", waiting=False)
        self.is_armed = True

    def stop(self, error: BaseException | None = None) -> None:
        """Stops watching (local). With ``error``, tells the peers first (best effort, bounded), so
        that ranks waiting on this one end soon instead of after the timeout."""
        if error is not None and not isinstance(error, Preempted):
            reason = f"rank {self.rank} failed at step {self.step}, round {self.round}: " \
                     f"{type(error).__name__}: {str(error)[:300]}"
            silent = self._silent_ranks()  # a collective that failed: did a peer die?
            if silent:
                _log(f"odb watchdog: rank {self.rank}: {silent} (the likely cause of {type(error).__name__})")
                reason += f"; {silent}"
            self._publish({"rank": self.rank, "reason": reason, "hard": False})
        self._stop.set()

    # ---- the threads ----------------------------------------------------------------------------

    def _record(self) -> dict[str, Any]:
        return {"seq": self._seq, "where": self.where, "step": self.step, "round": self.round,
                "waiting": self.is_waiting, "idle_s": round(time.monotonic() - self._progress_at, 1)}

    def _io_loop(self) -> None:
        peer_key = f"{_PREFIX}heartbeat/{self._peer}"
        while not self._stop.is_set():
            try:
                self._seq += 1
                self.store.set(f"{_PREFIX}heartbeat/{self.rank}", json.dumps(self._record()))
                if self._abort is None and self.store.check([_ABORT]):
                    self._abort = {**json.loads(self.store.get(_ABORT)), "seen_at": time.monotonic()}
                if self.world_size > 1 and self.store.check([peer_key]):
                    record = json.loads(self.store.get(peer_key))
                    if self._peer_seen is None or record["seq"] != self._peer_seen[0]:
                        self._peer_seen = (record["seq"], time.monotonic(), record)
                self._io_at = time.monotonic()
            except Exception:  # noqa: BLE001 - the judge counts the time since the last good cycle
                pass
            self._stop.wait(self.interval)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval / 2):
            fault = self._fault()
            if fault is not None and not self._stop.is_set():
                self._fail(*fault)
                return

    def _fault(self) -> tuple[str, bool] | None:
        """``(message, publish)`` for the first fault seen, or None."""
        now = time.monotonic()
        if self._abort is not None and self._abort["rank"] != self.rank:
            grace = 0 if self._abort["hard"] else self.slack  # a failed peer: its error reaches us too
            if now - self._abort["seen_at"] >= grace:
                return f"stopping: {self._abort['reason']}", False
        if now - self._io_at > self.timeout_s:
            return (f"{_store_address()} has not answered for {now - self._io_at:.0f} s: its host (rank 0's "
                    "process, or the launcher's agent) is frozen or gone"), False
        if self._peer_seen is not None and now - self._peer_seen[1] > self.timeout_s:
            last = self._peer_seen[2]
            return (f"rank {self._peer} stopped answering: no heartbeat for {now - self._peer_seen[1]:.0f} s "
                    f"(frozen, killed, or its node is down); its last: step {last['step']}, round "
                    f"{last['round']}, {last['where']!r}"), True
        idle = now - self._progress_at
        if self.is_armed and not self.is_waiting and idle > self.timeout_s + self.slack:
            return (f"rank {self.rank} made no progress for {idle:.0f} s at step {self.step}, round "
                    f"{self.round}: {self.where!r} (a stuck DataLoader worker, storage that does not "
                    "answer, or a step slower than --dist_timeout_s)"), True
        if self.is_armed and self.is_waiting and idle > self.timeout_s + 2 * self.slack:
            return (f"rank {self.rank} waited {idle:.0f} s on its peers at step {self.step}, round "
                    f"{self.round}: {self.where!r}; " + self._survey()), True
        return None

    def _heartbeats(self) -> list[dict[str, Any]]:
        keys = [f"{_PREFIX}heartbeat/{r}" for r in range(self.world_size)]
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def _survey(self) -> str:
        """Every rank's last heartbeat, read once (bounded): who the waiting ranks wait for."""
        def read() -> str:
            busy = [f"rank {r} at step {x['step']}, round {x['round']}, {x['where']!r}, idle {x['idle_s']} s"
                    for r, x in enumerate(self._heartbeats()) if not x["waiting"]]
            return "not waiting: " + "; ".join(busy) if busy else "every rank is waiting (a collective " \
                "that never completes: ranks in different collectives)"

        return _within(self.interval * 2, read) or "the store did not answer"

    def _silent_ranks(self) -> str:
        """Which ranks' heartbeats stand still over two intervals ('' if none; bounded in time)."""
        def read() -> str:
            before = [x["seq"] for x in self._heartbeats()]
            time.sleep(2 * self.interval)
            after = [x["seq"] for x in self._heartbeats()]
            silent = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
            return f"rank(s) {silent} stopped answering (no heartbeat)" if silent else ""

        if self.world_size == 1:
            return ""
        found = _within(3 * self.interval + 2, read)
        if found is not None:
            return found
        return f"{_store_address()} does not answer: its host (rank 0's process, or the launcher's agent) is gone"

    def _publish(self, abort: dict[str, Any]) -> None:
        """Writes the abort key unless one is there (first report wins), within a bounded time."""
        _within(min(5.0, self.interval * 2), lambda: self.store.compare_set(_ABORT, "", json.dumps(abort)))

    def _fail(self, message: str, publish: bool) -> None:
        if self._failed:
            return
        self._failed = True
        _log(f"odb watchdog: rank {self.rank} (step {self.step}, round {self.round}): {message}; "
             f"ending this rank with exit code {EXIT_STALLED}. Resume from the last checkpoint with --resume")
        if publish:
            self._publish({"rank": self.rank, "reason": message, "hard": True})
            time.sleep(2 * self.interval)  # the peers read it (rank 0's process takes the store with it)
        try:
            self.on_exit()
        finally:
            self._exit(EXIT_STALLED)


class WatchedCommunicator:
    """A :class:`~odb.batching.align.Communicator` that tells the watchdog when the rank waits on
    its peers (inside odb's all_gather), so that a rank stuck there is told apart from one stuck
    in its own work."""

    def __init__(self, comm, watchdog: Watchdog) -> None:
        self.comm, self.watchdog = comm, watchdog
        self.rank, self.world_size = comm.rank, comm.world_size

    @property
    def num_collectives(self) -> int:
        return self.comm.num_collectives

    def all_gather_v(self, values):
        self.watchdog.progress("waiting on the other ranks in odb's all_gather", waiting=True)
        try:
            return self.comm.all_gather_v(values)
        finally:
            self.watchdog.progress("planning the round's steps")

    def all_gather(self, values):
        return as_matrix(*self.all_gather_v(values))
