"""The watchdog's judge (odb.training.run.watchdog.Watchdog), in one process: three watchdogs on a real
TCPStore, the process exit replaced by a recorder, timeout 3 s (heartbeats every 0.5 s)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from launch import free_port
from odb.training.backends.process_group import attempt_prefix, connect_store
from odb.training.run.stop import GracefulStop
from odb.training.run.watchdog import EXIT_STALLED, Watchdog

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
    # not before the timeout (rank 2's last heartbeat was at most one interval before it went
    # silent); how much later is the machine's load, not judged (exits.wait bounds a hang)
    assert min(t for _, t in exits.codes.values()) - silent_at >= TIMEOUT_S - 2 * dogs[0].interval
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
    assert dogs[1].slack <= min(t for _, t in exits.codes.values()) - failed_at  # after the grace (how long: load)
    assert "stopping: rank 0 failed at step 0, round 0: RuntimeError: boom" in capfd.readouterr().err


def test_a_stopped_watchdog_reports_nothing(watchdogs):
    exits = Exits()
    dogs = [d.start() for d in watchdogs(exits, world=2)]
    for d in dogs:
        d.arm()
        d.stop()
    time.sleep(TIMEOUT_S * 1.5)
    assert not exits.codes


def test_a_restarted_attempt_does_not_read_the_abort_or_the_stop_step_of_the_attempt_before(monkeypatch):
    """``torchrun --max-restarts`` keeps one store (its agent's) and starts every rank again: the
    failed attempt's abort key made the next attempt exit 71 at once, its stop step stopped it at
    that step. One real TCPStore server for both attempts, each attempt's clients from connect_store
    with the attempt's environment as torchrun sets it."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    failed = Watchdog(connect_store(5), rank=1, world_size=1, timeout_s=TIMEOUT_S, exit=Exits().recorder(1))
    failed.stop(RuntimeError("boom in attempt 0"))  # rank 1 raised: its abort key tells the others
    signalled = GracefulStop(connect_store(5), rank=1)
    signalled.signal = "SIGTERM"
    assert not signalled.should_stop(4) and signalled.stop_after == 6  # attempt 0 agreed to stop after 6

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    exits = Exits()
    dogs = [Watchdog(connect_store(5), rank=r, world_size=2, timeout_s=TIMEOUT_S, exit=exits.recorder(r)).start()
            for r in range(2)]
    try:
        stop = GracefulStop(connect_store(5), rank=0)
        assert [stop.should_stop(k) for k in (1, 6, 7)] == [False] * 3 and stop.stop_after is None
        time.sleep(2 * dogs[0].slack)  # past the grace after a peer's abort: it would have exited by now
        assert not exits.codes, f"attempt 1 read attempt 0's abort: {exits.codes}"
        dogs[1].stop(RuntimeError("boom in attempt 1"))  # within one attempt the keys still meet
        exits.wait([0])
        assert exits.codes[0][0] == EXIT_STALLED
    finally:
        for dog in dogs:
            dog._stop.set()
    del server


def test_the_attempt_prefix_names_torchruns_restart_and_slurms_requeue():
    assert attempt_prefix({}) == "odb/restart0"
    assert attempt_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}) == "odb/restart2"
    assert attempt_prefix({"SLURM_RESTART_COUNT": "1"}) == "odb/restart0/requeue1"


def test_ranks_behind_watched_communicators_plan_what_the_raw_ones_plan_and_each_gather_is_marked_waiting(
        watchdogs):
    """The watchdog's communicator (every launch/train.py run's) carries odb's rounds, rows of any
    length, and says it waits on its peers inside each one."""
    from odb.batching.align import SimulatedGroup
    from odb.batching.batcher import OnlineBatcher
    from odb.batching.config import OdbConfig
    from odb.batching.simulate import SimulatedFeed, simulate
    from odb.training.run.watchdog import WatchedCommunicator

    lengths = [((7 * i) % 90 + 5, 0) for i in range(120)]
    config = OdbConfig(max_tokens=128, window=8, gas=2)
    dogs = watchdogs(Exits(), world=3)
    seen = [[] for _ in dogs]

    class Marking:  # (what the watchdog is told, in order: waiting, then planning)
        def __init__(self, dog, log):
            self.dog, self.log = dog, log

        def progress(self, where, *, waiting=False, **kwargs):
            self.log.append(waiting)
            self.dog.progress(where, waiting=waiting, **kwargs)

    def rank_main(comm):
        watched = WatchedCommunicator(comm, Marking(dogs[comm.rank], seen[comm.rank]))
        batcher = OnlineBatcher(config, watched, dataset_size=len(lengths), feed=SimulatedFeed(lengths))
        steps = [[m.uids for m in s.micro_batches] for s in batcher]
        assert batcher.gather_reports([comm.rank] * (comm.rank + 1)).shape == (3, 3)  # (the ragged final gather)
        return steps, batcher.round_index

    results = SimulatedGroup(3).run(rank_main)
    expected = [[[m.uids for m in s.micro_batches] for s in steps] for steps in simulate(config, lengths, 3).steps]
    assert [steps for steps, _ in results] == expected
    rounds = results[0][1]
    assert all(log == [True, False] * (rounds + 2) for log in seen)  # the settings check, the rounds, the final
