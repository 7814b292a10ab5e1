"""The watchdog's judge (odb.training.faults.Watchdog), in one process: three watchdogs on a real
TCPStore, the process exit replaced by a recorder, timeout 3 s (heartbeats every 0.5 s)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launch import free_port
from odb.training.faults import EXIT_STALLED, Watchdog

TIMEOUT_S = 3.0


class Exits:
    def __init__(self) -> None:
        self.codes: dict[int, tuple[int, float]] = {}

    def recorder(self, rank: int):
        def record(code: int) -> None:
            self.codes.setdefault(rank, (code, time.monotonic()))  # the judge thread then ends
        return record

    def wait(self, ranks, timeout=30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(r in self.codes for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    del master


@pytest.fixture
def watchdogs(store):
    made = []

    def make(exits, world=3):
        made.extend(Watchdog(store(), rank=r, world_size=world, timeout_s=TIMEOUT_S, exit=exits.recorder(r))
                    for r in range(world))
        return made[-world:]

    yield make
    for dog in made:
        dog._stop.set()


def test_a_silent_rank_is_named_by_its_watcher_and_every_other_rank_follows(watchdogs, capfd):
    exits = Exits()
    dogs = [d.start() for d in watchdogs(exits)]
    time.sleep(1.0)
    dogs[2]._stop.set()  # rank 2's threads stop, as a frozen process's would
    silent_at = time.monotonic()
    exits.wait([0, 1])
    assert {r: code for r, (code, _) in exits.codes.items()} == {0: EXIT_STALLED, 1: EXIT_STALLED}
    assert max(t for _, t in exits.codes.values()) - silent_at < TIMEOUT_S + 3
    err = capfd.readouterr().err
    assert "rank 1 (step 0, round 0): rank 2 stopped answering" in err  # rank 1 watches rank 2
    assert "rank 0 (step 0, round 0): stopping: rank 2 stopped answering" in err  # rank 0 read the abort key


def test_a_collective_that_never_completes_is_reported_by_the_waiting_ranks(watchdogs, capfd):
    exits = Exits()
    dogs = [d.start() for d in watchdogs(exits)]
    for d in dogs:
        d.arm()
        d.progress("waiting on the other ranks in odb's all_gather", step=4, round=2, waiting=True)
    exits.wait([0, 1, 2])
    assert len(exits.codes) == 3
    assert "every rank is waiting (a collective that never completes" in capfd.readouterr().err


def test_a_rank_without_progress_that_is_not_waiting_is_the_one_named(watchdogs, capfd):
    exits = Exits()
    dogs = [d.start() for d in watchdogs(exits)]
    for r, d in enumerate(dogs):
        d.arm()
        d.progress("fetching samples and planning" if r == 1 else "waiting on the other ranks", step=7, round=3,
                   waiting=r != 1)
    exits.wait([0, 1, 2])
    err = capfd.readouterr().err
    assert "rank 1 made no progress for" in err and "'fetching samples and planning'" in err
    assert err.count("stopping: rank 1 made no progress") == 2  # ranks 0 and 2 name rank 1 too


def test_a_store_that_stops_answering_ends_the_rank_naming_it(capfd):
    class FrozenStore:  # every call blocks, as a client of a SIGSTOPped store host does
        def __getattr__(self, name):
            return lambda *args, **kwargs: threading.Event().wait()

    exits = Exits()
    Watchdog(FrozenStore(), rank=1, world_size=2, timeout_s=TIMEOUT_S, exit=exits.recorder(1)).start()
    exits.wait([1])
    assert exits.codes[1][0] == EXIT_STALLED
    assert "the rendezvous store at" in capfd.readouterr().err


def test_a_rank_that_fails_tells_its_peers_which_end_after_a_grace(watchdogs, capfd):
    """A rank that raised (its shutdown stops its watchdog with the error): peers stuck in a
    collective that will never complete end one slack later, naming it."""
    exits = Exits()
    dogs = [d.start() for d in watchdogs(exits)]
    for d in dogs:
        d.arm()
    time.sleep(1.0)
    failed_at = time.monotonic()
    dogs[0].stop(RuntimeError("boom"))
    exits.wait([1, 2])
    assert set(exits.codes) == {1, 2}
    assert dogs[1].slack <= min(t for _, t in exits.codes.values()) - failed_at < 2 * TIMEOUT_S
    assert "stopping: rank 0 failed at step 0, round 0: RuntimeError: boom" in capfd.readouterr().err


def test_a_stopped_watchdog_reports_nothing(watchdogs):
    exits = Exits()
    dogs = [d.start() for d in watchdogs(exits, world=2)]
    for d in dogs:
        d.arm()
        d.stop()
    time.sleep(TIMEOUT_S * 1.5)
    assert not exits.codes
