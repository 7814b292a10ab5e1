"""A mixture's loss per source over ``--log_steps`` intervals where a process ends
(odb/telemetry/sources.py): the run's last interval is written at its last step, whole or not; a
stop closes it before its checkpoint, so the resumed process starts a new one; a checkpoint inside
an interval carries each rank's open sums, so a process resumed from it after a crash (the rows
past the checkpoint superseded) writes the interval as the uninterrupted run would, also on
another number of ranks. Every step is in exactly one interval.

Ranks' telemetry in one process, their reports gathered by hand as the batcher's rounds and the
final gather do. The oracle is each interval's per-source loss computed from the steps' own
figures (:func:`figures`): sum over the interval's steps and the ranks that trained them of the
source's token loss, over its label tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, StepPlan
from odb.telemetry import StepTimes, Telemetry

NAMES = ("alpha", "beta")
EVERY = 3  # --log_steps: intervals end at steps 2, 5, 8, ...
TIMES = StepTimes(wait=0, plan=0, collective=0, step=1.0, ended=0.0)


def figures(step: int, rank: int) -> tuple[tuple[float, float], tuple[int, int]]:
    """Rank ``rank``'s summed token loss and label tokens per source at ``step`` (distinct everywhere)."""
    tokens = (2 + rank, 3 if rank % 2 == 0 else 1)
    return (tokens[0] * (1.0 + 0.1 * step + 0.01 * rank), tokens[1] * (5.0 - 0.2 * step + 0.03 * rank)), tokens


def plan(step: int, world: int) -> StepPlan:
    sample = SampleCost(uid=step, tokens=10, label_tokens=5, patches=0, cost=10)
    return StepPlan(epoch=0, step=step, micro_batches=(MicroBatch((sample,)),), num_label_tokens=10, num_samples=2,
                    rank_costs=((10,) * world,), rank_tokens=((10,) * world,))


class Process:
    """One process of the run: its ranks' telemetry, resumed from ``states`` (a checkpoint's) if given."""

    def __init__(self, out: Path, world: int, states: list[dict] | None = None) -> None:
        self.world = world
        self.ranks = [Telemetry(rank=r, max_steps_per_round=4, max_tokens=64, dataset_size=100, output_dir=out)
                      for r in range(world)]
        for r, telemetry in enumerate(self.ranks):
            telemetry.set_sources(NAMES, every=EVERY)
            if states is not None:
                telemetry.load_state_dict(states[r])

    def train(self, steps: range) -> None:
        for step in steps:
            for r, telemetry in enumerate(self.ranks):
                loss, tokens = figures(step, r)
                telemetry.record(plan(step, self.world), loss_sum=sum(loss), lr=0.1, times=TIMES, source_loss=loss,
                                 source_label_tokens=tokens, source_samples=(1, 1))

    def round(self) -> None:
        """A round: it carries the steps trained since the last one."""
        gathered = np.stack([t.report({}) for t in self.ranks])
        for telemetry in self.ranks:
            telemetry.on_reports(gathered)

    def end(self) -> list[bool]:
        """The run's end or a stop (Trainer): the last interval closes on every rank."""
        return [t.end_interval() for t in self.ranks]

    def states(self) -> list[dict]:
        """A checkpoint's run states (JSON, as the files hold them)."""
        return [json.loads(json.dumps(t.state_dict({}, {}))) for t in self.ranks]

    def final(self) -> None:
        """The final gather (the run's end, or a stop after its checkpoint); the file closed."""
        gathered = np.stack([t.final_report({}, dropped=0) for t in self.ranks])
        for telemetry in self.ranks:
            telemetry.on_final_reports(gathered)
        self.ranks[0].close()

    def crash(self) -> None:
        """SIGKILL: no final gather; the rows written so far stay."""
        self.ranks[0].close()


def oracle(first: int, last: int, worlds: dict[int, int]) -> dict[str, float]:
    """``loss/<source>`` and ``label_tokens/<source>`` of the interval ``first``-``last`` from the
    figures of each step's ranks (``worlds``: the world size that trained each step)."""
    out = {}
    for s, name in enumerate(NAMES):
        parts = [figures(step, r) for step in range(first, last + 1) for r in range(worlds[step])]
        tokens = sum(p[1][s] for p in parts)
        out[f"loss/{name}"] = math.fsum(p[0][s] for p in parts) / tokens
        out[f"label_tokens/{name}"] = tokens
    return out


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check(out: Path, intervals: list[tuple[int, int]], worlds: dict[int, int], *, steps: int) -> None:
    written = rows(out)
    carrying = {r["step"]: r for r in written if "loss/alpha" in r}  # (a step's last row: a reader's)
    assert sorted(carrying) == [last for _, last in intervals]
    for first, last in intervals:
        for key, value in oracle(first, last, worlds).items():
            assert carrying[last][key] == pytest.approx(value, rel=1e-6), (first, last, key)
    assert [r["step"] for r in written if "loss" in r] == list(range(steps)), "every step's row once, in order"
    assert len([r for r in written if "loss/alpha" in r]) == len(intervals)
    # every step in exactly one interval: the intervals' label tokens are the run's
    for s, name in enumerate(NAMES):
        run = sum(figures(step, r)[1][s] for step in range(steps) for r in range(worlds[step]))
        assert sum(r[f"label_tokens/{name}"] for r in carrying.values()) == run


def test_the_runs_last_interval_is_written_at_its_last_step(tmp_path):
    run = Process(tmp_path, 2)
    run.train(range(4))
    run.round()
    run.train(range(4, 8))  # the last round's steps: reported on the final gather
    assert run.end() == [True, True]
    run.final()
    check(tmp_path, [(0, 2), (3, 5), (6, 7)], dict.fromkeys(range(8), 2), steps=8)


def test_a_run_ending_on_an_intervals_last_step_has_nothing_more_to_write(tmp_path):
    run = Process(tmp_path, 2)
    run.train(range(3))
    run.round()
    run.train(range(3, 6))
    assert run.end() == [False, False]
    run.final()
    check(tmp_path, [(0, 2), (3, 5)], dict.fromkeys(range(6), 2), steps=6)


def test_a_stop_writes_its_last_interval_and_the_resume_starts_a_new_one(tmp_path):
    first = Process(tmp_path, 2)
    first.train(range(4))
    first.round()
    first.train(range(4, 5))
    first.end()  # stopped on request after step 4: the interval 3-4 closes before the checkpoint
    states = first.states()
    assert all(state["source_interval"] is None for state in states)
    first.final()
    second = Process(tmp_path, 2, states)
    second.train(range(5, 8))
    second.end()
    second.final()
    # the new interval ends at the next multiple of --log_steps: 5 (one step), then 6-7 at the run's end
    check(tmp_path, [(0, 2), (3, 4), (5, 5), (6, 7)], dict.fromkeys(range(8), 2), steps=8)


def test_a_crash_after_a_checkpoint_inside_an_interval_resumes_it_as_the_uninterrupted_run(tmp_path):
    """Checkpoint after step 4 (inside the interval 3-5), rows of steps 4-6 written, then SIGKILL:
    the resumed process's row of step 5 holds steps 3-5, the uninterrupted run's."""
    first = Process(tmp_path, 2)
    first.train(range(4))
    first.round()
    first.train(range(4, 5))
    states = first.states()  # --save_steps 5
    first.train(range(5, 7))
    first.round()  # rows 4-6 (and the interval 3-5) written
    first.crash()
    second = Process(tmp_path, 2, states)
    second.train(range(5, 6))
    second.round()
    second.train(range(6, 9))
    second.final()
    check(tmp_path, [(0, 2), (3, 5), (6, 8)], dict.fromkeys(range(9), 2), steps=9)


def test_a_crash_resumed_on_another_number_of_ranks_keeps_the_open_intervals_sums(tmp_path):
    first = Process(tmp_path, 2)
    first.train(range(4))
    first.round()
    first.train(range(4, 5))
    states = Telemetry.redeal_states(first.states(), 3)  # the checkpoint after step 4, read by 3 ranks
    first.train(range(5, 6))
    first.round()
    first.crash()
    second = Process(tmp_path, 3, states)
    second.train(range(5, 9))
    second.final()
    worlds = {**dict.fromkeys(range(5), 2), **dict.fromkeys(range(5, 9), 3)}
    check(tmp_path, [(0, 2), (3, 5), (6, 8)], worlds, steps=9)


def test_a_last_interval_whose_row_was_written_before_it_closed_is_a_row_of_its_own(tmp_path):
    """A run whose last round planned no step: that round carried the last steps' reports, so their
    rows are written before the run knows its end; the last interval's figures come as a row of
    their own, of its last step."""
    run = Process(tmp_path, 2)
    run.train(range(3))
    run.round()
    run.train(range(3, 5))
    run.round()  # (the last round: no step planned)
    run.end()
    run.final()
    *steps, late = rows(tmp_path)
    assert [r["step"] for r in steps] == list(range(5)) and "loss/alpha" not in steps[-1]
    assert set(late) == {"step", "time", *(f"{key}/{name}" for key in ("loss", "label_tokens") for name in NAMES)}
    assert late["step"] == 4
    for key, value in oracle(3, 4, dict.fromkeys(range(5), 2)).items():
        assert late[key] == pytest.approx(value, rel=1e-6), key
