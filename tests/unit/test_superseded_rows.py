"""A resume after a hard crash: the earlier process wrote rows of steps past its last checkpoint,
then died. The resumed process trains those steps again, so their earlier rows leave
``metrics.jsonl`` for ``metrics.superseded.jsonl`` (odb/telemetry/writer.py) before its own rows:
``metrics.jsonl`` holds every step once, in order, and every line written is in one of the two
files. The oracle is the lines written, sorted by their own ``step``. (The launched run killed
with SIGKILL and resumed: tests/e2e/test_crash_resume.py.)"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from odb.batching.cost import SampleCost
from odb.batching.plan import MicroBatch, StepPlan
from odb.telemetry import StepTimes, Telemetry, writer

TIMES = StepTimes(wait=0, plan=0, collective=0, step=1.0, ended=0.0)


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def written(path, rows: list[dict], torn: str = "") -> list[str]:
    text = [json.dumps(row) for row in rows]
    path.write_text("".join(line + "\n" for line in text) + torn)
    return text + ([torn] if torn else [])


def test_the_rows_from_the_checkpoints_step_on_move_aside_and_the_rest_stay_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # a crashed process: steps 0-6, evaluations after steps 1, 3 (written after step 5's row, as a
    # round completes several steps at once) and 5, then a line cut by the kill; its checkpoint: 4 steps
    rows = [*({"step": s, "loss": 1.0 + s} for s in range(6)), {"step": 1, "eval_loss": 2.0},
            {"step": 3, "eval_loss": 1.5}, {"step": 6, "loss": 7.0}, {"step": 5, "eval_loss": 1.0}]
    every = written(path, rows, torn='{"step": 7, "lo')
    moved = writer.supersede_rows(path, 4)

    kept = [line for line in every[:-1] if json.loads(line)["step"] < 4]  # (oracle: each line's own step)
    assert lines(path) == kept  # in the order they were written
    aside = lines(tmp_path / writer.SUPERSEDED)
    assert aside == [line for line in every if line not in kept]
    assert Counter(lines(path) + aside) == Counter(every)  # nothing lost, nothing doubled
    assert moved == writer.Superseded(rows=5, first=4, last=6, torn=1)

    # a second crash and resume, from step 2: its rows join the file of superseded rows, after the first's
    assert writer.supersede_rows(path, 2) == writer.Superseded(rows=3, first=2, last=3)
    assert lines(path) == [kept[0], kept[1], kept[4]]  # steps 0, 1 and the evaluation after step 1
    assert lines(tmp_path / writer.SUPERSEDED) == aside + [kept[2], kept[3], kept[5]]


def test_a_file_without_rows_past_the_step_is_left_as_it_is(tmp_path):
    path = tmp_path / "metrics.jsonl"
    every = written(path, [{"step": s, "loss": 1.0} for s in range(3)])
    before = path.stat()
    assert writer.supersede_rows(path, 3) is None
    assert lines(path) == every and path.stat().st_ino == before.st_ino
    assert not (tmp_path / writer.SUPERSEDED).exists()
    assert writer.supersede_rows(tmp_path / "missing.jsonl", 0) is None


def test_a_line_cut_by_a_kill_moves_aside_alone_and_names_no_step(tmp_path):
    """A process killed while writing the row of a step before its checkpoint: the cut line would
    glue onto the resumed process's first row."""
    path = tmp_path / "metrics.jsonl"
    every = written(path, [{"step": s, "loss": 1.0} for s in range(3)], torn='{"step": 3, "lo')
    moved = writer.supersede_rows(path, 5)
    assert moved == writer.Superseded(rows=1, first=None, last=None, torn=1) and moved.steps is None
    assert lines(path) == every[:3] and lines(tmp_path / writer.SUPERSEDED) == [every[3]]
    assert path.read_text().endswith("\n")


def plan(step: int) -> StepPlan:
    sample = SampleCost(uid=step, tokens=10, label_tokens=5, patches=0, cost=10)
    return StepPlan(epoch=0, step=step, micro_batches=(MicroBatch((sample,)),), num_label_tokens=10, num_samples=2,
                    rank_costs=((10, 10),), rank_tokens=((10, 10),))


def train(ranks: list[Telemetry], steps: range, loss: float) -> None:
    """Both ranks train ``steps`` (step s: loss ``loss + s``), then a round gathers their reports."""
    for step in steps:
        for telemetry in ranks:
            telemetry.record(plan(step), loss_sum=(loss + step) * 5, lr=0.1, times=TIMES)  # (/ 10 labels)
    gathered = np.stack([t.report({}) for t in ranks])
    for telemetry in ranks:
        telemetry.on_reports(gathered)


def test_a_resumed_run_writes_each_step_once_in_order_the_resumed_processes_rows(tmp_path):
    """Two ranks' telemetry: a process saves after 4 steps, writes the rows of 7, dies; the next
    resumes the checkpoint and trains steps 4-9: metrics.jsonl has steps 0-9 once each, in order,
    those from 4 on the resumed process's (loss 10 + s), the earlier ones aside."""
    def process() -> list[Telemetry]:
        return [Telemetry(rank=r, max_steps_per_round=4, max_tokens=64, dataset_size=100, output_dir=tmp_path)
                for r in range(2)]

    first = process()
    train(first, range(4), loss=1.0)
    states = [t.state_dict({}, {}) for t in first]  # the checkpoint after step 3
    train(first, range(4, 7), loss=1.0)
    first[0].close()  # (SIGKILL: no final gather, no summary)

    second = process()
    for telemetry, state in zip(second, states, strict=True):
        telemetry.load_state_dict(state)
    train(second, range(4, 8), loss=10.0)
    train(second, range(8, 10), loss=10.0)
    second[0].close()

    rows = [json.loads(line) for line in lines(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(10))
    assert [r["loss"] for r in rows] == [1.0 + s for s in range(4)] + [10.0 + s for s in range(4, 10)]
    aside = [json.loads(line) for line in lines(tmp_path / "metrics.superseded.jsonl")]
    assert [(r["step"], r["loss"]) for r in aside] == [(s, 1.0 + s) for s in range(4, 7)]
