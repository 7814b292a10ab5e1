"""summary.json's loss_first (and loss_last) after a resume: the run's first losses come from the checkpoint, or,
where its first steps' rows were completed only after it, from the run's metrics.jsonl, but only
rows of steps before the checkpoint (later rows are of steps the resume trains again)."""

import json

from odb.telemetry import first_losses, step_losses


def write_rows(path, rows, torn: bool = False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + ('{"step": 9, "lo' if torn else ""))


def row(step: int, loss: float, labels: int = 5) -> dict:
    return {"step": step, "loss": loss, "label_tokens": labels}


def test_rows_past_the_checkpoint_are_not_the_runs_first(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # a process that died after step 1's row; its checkpoint was after step 0; then a resume retrained step 1
    write_rows(path, [row(0, 1.0), row(1, 2.0), row(1, 2.0), row(2, 3.0), row(3, 4.0)])
    assert first_losses(path, [], before=1) == [1.0]
    assert first_losses(path, [], before=3) == [1.0, 2.0, 3.0]  # (step 1's row twice: counted once)
    assert first_losses(path, [1.0, 2.0], before=1) == [1.0, 2.0]  # the checkpoint knows more: kept


def test_steps_without_labels_evaluations_and_a_torn_line_are_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [row(0, 0.0, labels=0), {"step": 0, "eval_loss": 5.0}, row(1, 2.5), row(2, 2.0)], torn=True)
    assert first_losses(path, [], before=9) == [2.5, 2.0]
    assert first_losses(tmp_path / "missing.jsonl", [7.0], before=9) == [7.0]


def test_the_last_losses_before_a_resume_are_the_latest_rows_of_each_step(tmp_path):
    """loss_last of a resume that trains fewer than 3 steps: the run's last losses before it, a
    step's latest row (the run the checkpoint descends from) where an older resume repeated it."""
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [row(0, 1.0), row(1, 2.0), row(2, 3.0), row(3, 4.0), row(2, 3.5), row(3, 4.5), row(4, 5.0)])
    assert step_losses(path, before=4) == [1.0, 2.0, 3.5, 4.5]
    assert step_losses(path, before=4)[-3:] == [2.0, 3.5, 4.5]
    assert step_losses(tmp_path / "missing.jsonl", before=4) == []
