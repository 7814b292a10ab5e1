"""The output folder's policy (odb/training/cli.py), before any process group: a fresh run refuses
a folder that holds an earlier run unless told to continue it (``--resume``) or to start over
(``--overwrite_output_dir``: the earlier run's records removed, by rank 0 only); ``--resume auto``
continues from the latest checkpoint if there is one, else starts over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import train_defaults
from odb.training.cli import parse_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DEFAULTS = train_defaults()


@pytest.fixture(autouse=True)
def _rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "0")


def parse(out: Path, *flags: str):
    return parse_config(["--output_dir", str(out), *flags], defaults=DEFAULTS)


def earlier_run(out: Path, *, checkpoints: bool = True, latest: bool = True) -> Path:
    """A folder as a finished 2-rank run leaves it, plus files of the user's that odb never wrote."""
    if checkpoints:
        (out / "checkpoints" / "step3").mkdir(parents=True)
        (out / "checkpoints" / "step3" / "odb_state.rank0.json").write_text("{}")
        if latest:
            (out / "checkpoints" / "latest").write_text("step3")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    (out / "summary.json").write_text("{}")
    for rank in range(2):
        (out / f"emitted_ids.rank{rank}.jsonl").write_text("")
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "wandb").mkdir()
    return out


def names(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "metrics-only"])
def test_a_fresh_run_refuses_a_folder_that_holds_an_earlier_run_naming_the_fix(tmp_path, checkpoints):
    out = earlier_run(tmp_path / "run", checkpoints=checkpoints)
    before = names(out)
    with pytest.raises(ValueError, match=r"holds an earlier run \(.*metrics.jsonl.*\): pass --resume to continue "
                                         r"it, --overwrite_output_dir to start over \(removes them\)"):
        parse(out)
    assert names(out) == before, "a refusal touches nothing"


def test_overwrite_removes_the_earlier_runs_records_and_nothing_else(tmp_path, capsys):
    out = earlier_run(tmp_path / "run")
    config = parse(out, "--overwrite_output_dir")
    assert config.checkpoints.resume is None
    assert names(out) == {"notes.txt", "wandb"}
    assert "starting over in" in capsys.readouterr().out
    assert parse(out).checkpoints.resume is None  # nothing of a run left: a plain fresh run goes ahead


def test_only_rank_0_removes_the_other_ranks_pass(tmp_path, monkeypatch):
    out = earlier_run(tmp_path / "run")
    before = names(out)
    monkeypatch.setenv("RANK", "1")
    assert parse(out, "--overwrite_output_dir").checkpoints.resume is None
    assert names(out) == before


def test_empty_folders_and_an_empty_checkpoints_folder_are_no_earlier_run(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert parse(tmp_path / "run").checkpoints.resume is None
    assert parse(tmp_path / "new").checkpoints.resume is None


def test_resume_and_overwrite_together_are_refused(tmp_path):
    out = earlier_run(tmp_path / "run")
    with pytest.raises(ValueError, match="pass one of them"):
        parse(out, "--resume", "--overwrite_output_dir")
    assert (out / "checkpoints" / "latest").is_file()


def test_resume_needs_checkpoints(tmp_path):
    out = earlier_run(tmp_path / "run", checkpoints=False)
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoints in"):
        parse(out, "--resume")
    assert parse(earlier_run(tmp_path / "other"), "--resume", "step3").checkpoints.resume == "step3"


def test_resume_auto_continues_from_latest_or_starts_over(tmp_path):
    out = earlier_run(tmp_path / "run")
    before = names(out)
    assert parse(out, "--resume", "auto").checkpoints.resume == "latest"
    assert names(out) == before
    assert parse(tmp_path / "new", "--resume", "auto").checkpoints.resume is None
    # an attempt that failed before its first checkpoint: nothing to continue, its records replaced
    failed = earlier_run(tmp_path / "failed", checkpoints=False)
    assert parse(failed, "--resume", "auto").checkpoints.resume is None
    assert names(failed) == {"notes.txt", "wandb"}


def test_resume_auto_refuses_checkpoints_without_latest_naming_them(tmp_path):
    out = earlier_run(tmp_path / "run", latest=False)
    with pytest.raises(ValueError, match=r"holds \['step3'\] but no 'latest'.*--resume TAG"):
        parse(out, "--resume", "auto")
    assert (out / "checkpoints" / "step3").is_dir()
