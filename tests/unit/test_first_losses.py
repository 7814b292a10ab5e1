"""summary.json's loss_first after a resume: the run's first losses come from the checkpoint, or,
where its first steps' rows were completed only after it, from the run's metrics.jsonl, but only
rows of steps before the checkpoint (later rows are of steps the resume trains again)."""

import json

from odb.telemetry import first_losses


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
