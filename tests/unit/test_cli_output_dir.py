"""The output folder's policy (odb/training/launch/flags.py), before any process group: a fresh run refuses
a folder that holds an earlier run unless told to continue it (``--resume``) or to start over
(``--overwrite_output_dir``: the earlier run's records removed, by rank 0 only); ``--resume auto``
continues from the latest checkpoint if there is one (without 'latest', a job killed in a save:
the newest complete tag, over each backend's file set, tests/checkpoint_tags.py), else starts over."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoint_tags import write_tag
from conftest import train_defaults
from odb.training.launch.flags import parse_config
from odb.training.launch.output_dir import DERIVED

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
    (out / "metrics.superseded.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")  # (a crash, resumed)
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


def test_a_reference_table_is_no_earlier_run_kept_by_a_restart_and_removed_by_overwrite(tmp_path):
    """--reference precompute's tables (odb.training.run.reference): checked against what made them
    before they are used again, so they alone do not make an earlier run; --resume auto starting
    over (a restarted attempt that saved nothing) keeps them, --overwrite_output_dir removes them."""
    out = tmp_path / "run"
    out.mkdir()
    for name in DERIVED:
        (out / name).write_text("")
    assert parse(out).checkpoints.resume is None and names(out) == set(DERIVED)
    (out / "metrics.jsonl").write_text("")  # a first attempt that failed before its first checkpoint
    assert parse(out, "--resume", "auto").checkpoints.resume is None and names(out) == set(DERIVED)
    (out / "metrics.jsonl").write_text("")
    assert parse(out, "--overwrite_output_dir").checkpoints.resume is None and names(out) == set()


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
    (failed / "summary.json").unlink()
    shutil.rmtree(failed / "hf")
    assert parse(failed, "--resume", "auto").checkpoints.resume is None
    assert names(failed) == {"notes.txt", "wandb"}


def test_resume_auto_never_replaces_a_finished_run(tmp_path):
    """A run that finished without a checkpoint (--no_final_checkpoint) submitted again by the same
    sbatch command (which passes --resume auto): its summary and export were removed and training
    started over. Now refused, naming --overwrite_output_dir."""
    out = earlier_run(tmp_path / "run", checkpoints=False)
    before = names(out)
    with pytest.raises(ValueError, match=r"holds a finished run \(summary.json, hf\) and no checkpoint.*"
                                         r"--overwrite_output_dir"):
        parse(out, "--resume", "auto")
    assert names(out) == before


def test_a_restarted_attempt_reads_overwrite_as_resume_auto(tmp_path, monkeypatch, capsys):
    """torchrun --max-restarts starts every attempt with the same flags: --overwrite_output_dir removed
    the first attempt's checkpoints at every restart. In a restart it continues instead."""
    out = earlier_run(tmp_path / "run")
    before = names(out)
    for variable in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.setenv(variable, "1")
        assert parse(out, "--overwrite_output_dir").checkpoints.resume == "latest"
        assert names(out) == before and "read as --resume auto" in capsys.readouterr().out
        monkeypatch.setenv(variable, "0")
    assert parse(out, "--overwrite_output_dir").checkpoints.resume is None  # the first attempt starts over
    assert names(out) == {"notes.txt", "wandb"}


def test_nothing_the_run_reads_is_removed(tmp_path):
    """A second stage trained from the first stage's export in the same folder: starting over would
    remove the model it is about to load."""
    out = earlier_run(tmp_path / "run")
    (out / "hf" / "data.jsonl").write_text((ROOT / "data" / "chat.jsonl").read_text())
    before = names(out)
    with pytest.raises(ValueError, match=r"--data .*hf/data.jsonl lies in .*hf, which starting over .* would remove"):
        parse(out, "--overwrite_output_dir", "--data", str(out / "hf" / "data.jsonl"))
    assert names(out) == before
    with pytest.raises(ValueError, match=r"--data .*hf/data.jsonl lies in .*hf"):  # a named source's path
        parse(out, "--overwrite_output_dir", "--data", f"mine={out / 'hf' / 'data.jsonl'}:1",
              f"chat={ROOT / 'data' / 'chat.jsonl'}:1")
    assert names(out) == before


def test_flags_are_never_abbreviated(tmp_path):
    """launch/slurm.sbatch reads --output_dir, --resume and --overwrite_output_dir by name: argparse's
    abbreviations (--overwrite, --output) got past it."""
    with pytest.raises(SystemExit):
        parse_config(["--output", str(tmp_path / "run")], defaults=DEFAULTS)
    with pytest.raises(SystemExit):
        parse(tmp_path / "run", "--overwrite")


# ---- --resume auto where no 'latest' names a checkpoint: a job killed while saving -----------------

BACKEND_FLAGS = {"deepspeed": (), "fsdp2": ("--backend", "fsdp2")}
LAST_WRITTEN = {"deepspeed": "zero_pp_rank_1_mp_rank_00_optim_states.pt", "fsdp2": "fsdp2/.metadata"}
"""A file the backend's save writes last: without it, the save did not finish."""


def killed_in_save(checkpoints: Path, tag: str, backend: str) -> dict[str, bytes]:
    """A tag as a job killed in its save leaves it (the backend's last file not written); its files."""
    folder = write_tag(checkpoints, tag, backend=backend)
    (folder / LAST_WRITTEN[backend]).unlink()
    return files(folder)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("backend", BACKEND_FLAGS)
def test_resume_auto_without_latest_resumes_from_the_newest_complete_checkpoint(tmp_path, capsys, backend):
    """A job killed in a save (here its third) leaves a tag and no 'latest' naming it (the backend
    writes 'latest' last; here it is gone too): --resume auto refused the folder. It resumes from
    the newest complete tag (by step: step10, not step2), the incomplete one moved aside whole, in
    one line; nothing else touched."""
    out = tmp_path / "run"
    for tag in ("step2", "step10"):
        write_tag(out / "checkpoints", tag, backend=backend)
    killed = killed_in_save(out / "checkpoints", "step12", backend)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    assert parse(out, "--resume", "auto", *BACKEND_FLAGS[backend]).checkpoints.resume == "step10"
    aside = out / "incomplete_checkpoints" / "step12"
    assert capsys.readouterr().out == (
        f"odb: --resume auto: {out / 'checkpoints'} has no 'latest' (a save that did not finish): resuming from "
        f"step10, the newest complete checkpoint; moved the incomplete step12 ({LAST_WRITTEN[backend]} missing) "
        f"to {aside}\n")
    assert files(aside) == killed and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step10", "step2"]
    assert names(out) == {"checkpoints", "incomplete_checkpoints", "metrics.jsonl"}


@pytest.mark.parametrize("backend", BACKEND_FLAGS)
def test_resume_auto_with_no_complete_checkpoint_starts_over_moving_the_incomplete_aside(tmp_path, capsys, backend):
    """A job killed in its first save: no checkpoint to continue. --resume auto starts over, as
    after an attempt that failed before its first save (its records replaced), and moves the tag
    aside whole rather than deleting it; the same again keeps both attempts' tags."""
    out = tmp_path / "run"
    killed = killed_in_save(out / "checkpoints", "step2", backend)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    (out / "notes.txt").write_text("mine")
    assert parse(out, "--resume", "auto", *BACKEND_FLAGS[backend]).checkpoints.resume is None
    aside = out / "incomplete_checkpoints"
    assert capsys.readouterr().out == (
        f"odb: --resume auto: no complete checkpoint in {out / 'checkpoints'}: starting over in {out}; moved the "
        f"incomplete step2 ({LAST_WRITTEN[backend]} missing) to {aside / 'step2'}; removed the earlier run's "
        "metrics.jsonl\n")
    assert files(aside / "step2") == killed and not list((out / "checkpoints").iterdir())
    assert names(out) == {"checkpoints", "incomplete_checkpoints", "notes.txt"}

    again = killed_in_save(out / "checkpoints", "step2", backend)  # the next attempt killed in its first save too
    assert parse(out, "--resume", "auto", *BACKEND_FLAGS[backend]).checkpoints.resume is None
    assert f"to {aside / 'step2.1'}" in capsys.readouterr().out
    assert files(aside / "step2") == killed and files(aside / "step2.1") == again


def test_only_rank_0_moves_an_incomplete_checkpoint_the_others_decide_alike(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    write_tag(out / "checkpoints", "step2", backend="fsdp2")
    killed_in_save(out / "checkpoints", "step4", "fsdp2")
    monkeypatch.setenv("RANK", "1")
    assert parse(out, "--resume", "auto").checkpoints.resume == "step2"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step2", "step4"]
    assert capsys.readouterr().out == ""
    shutil.rmtree(out / "checkpoints" / "step2")
    assert parse(out, "--resume", "auto").checkpoints.resume is None
    assert (out / "checkpoints" / "step4").is_dir() and names(out) == {"checkpoints"}


def test_resume_auto_never_replaces_a_finished_run_with_incomplete_checkpoints(tmp_path):
    out = earlier_run(tmp_path / "run", latest=False)  # (its step3 holds one file: incomplete)
    before = names(out)
    with pytest.raises(ValueError, match=r"holds a finished run \(summary.json, hf\) and no complete checkpoint"):
        parse(out, "--resume", "auto")
    assert names(out) == before and (out / "checkpoints" / "step3").is_dir()
