"""A hard crash after a checkpoint, then ``--resume``: 2 ranks (each its own process) on a mixture
of two sources, a checkpoint every 4 steps, per-source loss over 5-step intervals, TensorBoard;
both ranks killed with SIGKILL once rows past the latest checkpoint are written. The
resumed process supersedes those rows (odb/telemetry/writer.py): metrics.jsonl holds every step
once, in order; the earlier rows are in metrics.superseded.jsonl as they were, and the steps
trained again have the losses the earlier process logged for them (the same steps from the same
checkpoint). The interval the checkpoint cut in two is written whole, by the resumed process,
from the open sums the checkpoint carried (odb/telemetry/sources.py). TensorBoard shows each step
once. (MLflow and W&B keep the earlier values and name the steps on the run: in one process,
tests/unit/test_trackers.py; MLflow's file store cannot hold a mixture's ``loss`` beside
``loss/<source>``, so it is not launched here.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launch import ROOT, Run, deepspeed, ds_config, odb_config

SAVE_STEPS, LOG_STEPS = 4, 5  # every checkpoint step (4, 8, 12, 16) falls inside a log interval
SOURCES = ("chat", "more")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def step_of(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None  # a line cut by the kill


def latest(out: Path) -> int | None:
    path = out / "checkpoints" / "latest"
    return int(path.read_text().strip()[4:]) if path.is_file() else None


def past_the_checkpoint(out: Path) -> bool:
    """A checkpoint is saved and metrics.jsonl has rows of two steps after it."""
    saved = latest(out)
    steps = [step_of(line) for line in lines(out / "metrics.jsonl")]
    return saved is not None and max((s for s in steps if s is not None), default=-1) >= saved + 1


def tensorboard_loss(out: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("loss")]


def test_a_run_killed_after_a_checkpoint_resumes_with_every_step_once(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    chat = (ROOT / "data" / "chat.jsonl").read_text().splitlines()
    data = []
    for i, name in enumerate(SOURCES):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(line + "\n" for line in chat[60 * i:60 * (i + 1)]))
        data.append(f"{name}={path}")
    out = tmp_path / "out"
    args = ["--deepspeed_config", str(ds_config(tmp_path, 2)),
            "--odb_config", str(odb_config(tmp_path, max_tokens=256, window=16, lookahead=8)),
            "--data", *data, "--output_dir", str(out), "--save_steps", str(SAVE_STEPS),
            "--log_steps", str(LOG_STEPS), "--no_final_checkpoint", "--report_to", "tensorboard"]
    run = Run(args, nproc=2, apart=True)
    try:
        while True:  # both ranks frozen while we look: no checkpoint can land between the look and the kill
            run.wait_for(lambda: past_the_checkpoint(out))
            ranks = [run.rank_process(r) for r in range(2)]
            for rank in ranks:
                rank.suspend()
            if past_the_checkpoint(out):
                break
            for rank in ranks:
                rank.resume()
            time.sleep(0.5)
    finally:
        run.kill()  # SIGKILL to every rank and its DataLoader workers: no final gather, no save
    saved = latest(out)
    before = lines(out / "metrics.jsonl")
    kept = [line for line in before if step_of(line) is not None and step_of(line) < saved]
    superseded = [line for line in before if line not in kept]
    assert superseded and saved % LOG_STEPS, "the kill falls after rows past a checkpoint inside an interval"

    proc = deepspeed([*args, "--resume"])
    print(f"killed after the rows of steps {saved}-{max(filter(None, map(step_of, before)))}, checkpoint step{saved}")

    # metrics.jsonl: every step once, in order; the earlier process's rows before the checkpoint as they were
    after = lines(out / "metrics.jsonl")
    every = [json.loads(line) for line in after]
    rows = [r for r in every if "loss" in r]  # (and a last interval's own row, where its step's went first)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in rows] == list(range(summary["steps"])) and summary["steps"] > saved + 2
    assert after[:len(kept)] == kept
    assert lines(out / "metrics.superseded.jsonl") == superseded  # nothing lost: aside, as written
    assert f"{len(superseded)} row(s) of steps {saved}-" in proc.stdout and "moved to metrics.superseded.jsonl" \
        in proc.stdout, proc.stdout[-3000:]
    again = {row["step"]: row for row in (json.loads(x) for x in superseded if step_of(x) is not None)}
    for step, earlier in again.items():  # the same steps from the same checkpoint: the same losses
        assert rows[step]["loss"] == pytest.approx(earlier["loss"], rel=1e-5, abs=1e-6), step
        assert rows[step]["label_tokens"] == earlier["label_tokens"] and rows[step]["time"] > earlier["time"]

    # per-source loss: intervals of LOG_STEPS steps and the run's last, each step in exactly one;
    # each interval's per-source figures add up to its steps' own, the one the checkpoint cut included
    last = summary["steps"] - 1
    ends = [s for s in range(summary["steps"]) if (s + 1) % LOG_STEPS == 0 or s == last]
    carrying = [r for r in every if f"loss/{SOURCES[0]}" in r]
    assert [r["step"] for r in carrying] == ends
    for row, end, start in zip(carrying, ends, [0] + [e + 1 for e in ends[:-1]]):
        steps = rows[start:end + 1]
        tokens = {name: row[f"label_tokens/{name}"] for name in SOURCES}
        assert sum(tokens.values()) == sum(r["label_tokens"] for r in steps), (start, end)
        by_source = sum(row[f"loss/{name}"] * n for name, n in tokens.items() if n)
        assert by_source == pytest.approx(sum(r["loss"] * r["label_tokens"] for r in steps), rel=1e-5), (start, end)

    # TensorBoard: each step once, metrics.jsonl's value (purge_step hides the earlier process's)
    assert tensorboard_loss(out) == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
