"""W&B (offline, for real) under the environment a user sets and the output folder odb replaces:
the project is --wandb_project, else WANDB_PROJECT, else odb; --overwrite_output_dir starts the
W&B runs over. Each tracker run in a process of its own, as rank 0's is (W&B starts its service
process, which no unit test may); read back from the offline run files. (TensorBoard and MLflow,
in one process: tests/unit/test_trackers.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, train_defaults
from odb.training.launch.flags import parse_config
from wandb_offline import offline_runs, read_wandb_history, read_wandb_run

RANK_0 = """
import sys
from pathlib import Path
from odb.telemetry.trackers import Trackers
from odb.training.launch.flags import FileDefaults, parse_config
from odb.training.run.assemble import _run_info
root, loss, flags = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
config = parse_config(flags, defaults=FileDefaults.bundled(root))  # (the run's flags, as rank 0 builds its trackers)
trackers = Trackers(config.logging.report_to, _run_info(config, {"lr": 1.0}, config.batching))
trackers.start(0, log=print)
for step in range(2):
    trackers.log({"step": step, "time": 1_700_000_000.0 + step, "loss": loss + step})
for tracker in trackers:
    tracker.finish(0)
"""


def wandb_run(out: Path, *, project: str | None, loss: float = 1.0, environ: dict[str, str] | None = None) -> None:
    """Rank 0's W&B run of two rows in ``out`` (``project``: ``--wandb_project``), offline, its
    trackers built from the run's flags."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", **(environ or {}))
    flags = ["--output_dir", str(out), "--report_to", "wandb",
             *(["--wandb_project", project] if project else [])]
    proc = subprocess.run([sys.executable, "-c", RANK_0, str(ROOT), str(loss), *flags], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize(("flag", "environ", "project"), [
    ("mine", {"WANDB_PROJECT": "theirs"}, "mine"), (None, {"WANDB_PROJECT": "theirs"}, "theirs"), (None, {}, "odb"),
], ids=["flag", "environment", "default"])
def test_the_wandb_project_is_the_flag_else_wandb_project_else_odb(tmp_path, flag, environ, project):
    """launch/slurm.sbatch's docs export WANDB_PROJECT; it did nothing (odb passed --wandb_project's
    default, odb, to wandb.init over it)."""
    out = tmp_path / "run"
    out.mkdir()
    wandb_run(out, project=flag, environ=environ)
    (run,) = offline_runs(out)
    assert read_wandb_run(run)["project"] == project
    assert [row["loss"] for row in read_wandb_history(run)] == [1.0, 2.0]


def test_overwrite_output_dir_starts_the_wandb_runs_over(tmp_path, monkeypatch):
    """--overwrite_output_dir left wandb/ (and trackers.json): the fresh run's offline run folder
    beside the earlier run's, which `wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads with it."""
    out = tmp_path / "run"
    out.mkdir()
    wandb_run(out, project="p", loss=1.0)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    (first,) = offline_runs(out)
    earlier = read_wandb_run(first)["id"]
    assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] == earlier
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "0")
    parse_config(["--output_dir", str(out), "--overwrite_output_dir"], defaults=train_defaults())
    assert not [p.name for p in out.iterdir()]
    wandb_run(out, project="p", loss=5.0)
    (run,) = offline_runs(out)
    assert read_wandb_run(run)["id"] != earlier and [row["loss"] for row in read_wandb_history(run)] == [5.0, 6.0]
