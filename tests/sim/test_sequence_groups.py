"""Sequence-parallel groups under the real batcher (odb.batching.align.SequenceGroups): 6 simulated
processes as 3 groups of 2. Each process runs its own batcher; the oracle is the data itself and a
plain run of 3 ranks: the processes of a group get the very same plans (even where their measured
times differ: the fit takes the group's first process's), the groups are aligned and train every
sample exactly once, as 3 plain ranks do; a process that fetches other sizes than its group, or
fails, stops every process instead of training different rows or hanging."""

from collections import Counter

import numpy as np
import pytest

from conftest import check_aligned, check_exact_once
from odb.batching.align import PeerStopped, SequenceGroups
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import SimulatedFeed, run_ranks

GROUPS, SIZE = 3, 2
LENGTHS = [(int(n), 0) for n in np.random.default_rng(3).lognormal(5.0, 1.1, 300).clip(8, 4000)]


def config(**overrides):
    return OdbConfig(**{"max_tokens": 4096, "window": 16, "lookahead": 8, "gas": 2, "cost_model": "fit",
                        "seed": 2, **overrides})


def run(feeds=None, grouped=True, cfg=None):
    """Every process's plans (a plain run: every rank's); a process's forward times depend on its index."""
    cfg = cfg or config()

    def rank_main(comm):
        comm = SequenceGroups(comm, SIZE) if grouped else comm
        feed = feeds(comm) if feeds else SimulatedFeed(LENGTHS)
        batcher = OnlineBatcher(cfg, comm, dataset_size=len(LENGTHS), feed=feed, num_epochs=2)
        steps = []
        for step in batcher:
            steps.append(step)
            member = getattr(comm, "comm", comm).rank
            batcher.observe(step, [1e-4 * (1 + member) * m.tokens / 1000 + 1e-3 for m in step.micro_batches])
        return steps

    return run_ranks(GROUPS * SIZE if grouped else GROUPS, rank_main)


def test_the_processes_of_a_group_run_the_same_plans_and_the_groups_train_each_sample_once():
    steps = run()
    for group in range(GROUPS):
        assert steps[group * SIZE] == steps[group * SIZE + 1], f"group {group}'s processes planned differently"
    leaders = steps[::SIZE]
    check_aligned(leaders)
    check_exact_once(leaders, Counter({e * len(LENGTHS) + i: 1 for e in range(2) for i in range(len(LENGTHS))}))
    plain = run(grouped=False, cfg=config(cost_model="manual"))  # 3 plain ranks, the same samples
    check_exact_once(plain, Counter(u for s in leaders for p in s for m in p.micro_batches for u in m.uids))
    print(f"{len(leaders[0])} steps per group of {SIZE}, as {len(plain[0])} for 3 plain ranks")


class OtherSizes(SimulatedFeed):
    """A feed whose samples are one token longer than its group's other process's (a data worker
    that processes differently)."""

    def fetch(self, uids):
        return [(tokens + 1, labels + 1, patches) for tokens, labels, patches in super().fetch(uids)]


def test_a_process_that_fetches_other_sizes_than_its_group_stops_every_process():
    def feeds(comm):
        return OtherSizes(LENGTHS) if comm.comm.rank == 3 else SimulatedFeed(LENGTHS)

    with pytest.raises(RuntimeError, match=r"group\(s\) \[1\] proposed different"):
        run(feeds)


class Failing(SimulatedFeed):
    def fetch(self, uids):
        raise OSError("the image file is unreadable here")


def test_a_process_that_fails_stops_its_group_and_the_others_without_a_hang():
    errors = {}

    def rank_main(comm):
        grouped = SequenceGroups(comm, SIZE)
        feed = Failing(LENGTHS) if comm.rank == 5 else SimulatedFeed(LENGTHS)
        try:
            for _ in OnlineBatcher(config(), grouped, dataset_size=len(LENGTHS), feed=feed):
                pass
        except (OSError, PeerStopped) as err:
            errors[comm.rank] = type(err).__name__
            raise

    with pytest.raises(OSError, match="unreadable"):
        run_ranks(GROUPS * SIZE, rank_main, timeout_s=30)
    assert errors == {**{r: "PeerStopped" for r in range(5)}, 5: "OSError"}
