"""--report_to and the trackers behind it (odb/telemetry/trackers.py), in one process: the setting's
parsing and errors, a missing package refused before any process group, the lazy imports, and a
TensorBoard + MLflow run (and a resume of it) read back with TensorBoard's and MLflow's own
readers. The launched run with every tracker at once: tests/e2e/test_trackers_launch.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, train_defaults
from odb.telemetry.trackers import RUN_IDS, TRACKERS, RunInfo, Trackers, check_installed, wandb_project
from odb.telemetry.writer import Superseded
from odb.training.config.settings import LoggingSettings
from odb.training.launch.flags import parse_config

PARAMS = {"world_size": 2, "lr": 1e-3, "model": "tiny", "lora": False, "odb": {"max_tokens": 512, "policy": "odb"},
          "fsdp2": None, "long": "x" * 600}


def step_row(step: int, loss: float) -> dict:
    """A metrics.jsonl training row's shape (odb/telemetry/rows.py): numbers, a nested count, a time."""
    return {"step": step, "epoch": 0, "time": 1_700_000_000.0 + step, "loss": loss, "lr": 1e-3 * (step + 1),
            "samples": 4, "real_tokens": 900 + step, "padding_ratio": 0.0, "budget_fill": 0.875,
            "sync_efficiency": 0.5 + step / 100, "tokens_per_s": 1234.5, "skipped": {"no_labels": step}}


def eval_row(step: int, loss: float | None) -> dict:
    return {"step": step, "eval_loss": loss, "eval_label_tokens": 50, "eval_samples": 5, "eval_over_cap": 0,
            "eval_s": 0.25, "time": 1_700_000_000.5 + step}


# ---- the setting ---------------------------------------------------------------------------------

@pytest.fixture
def parse(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "0")
    return lambda *flags: parse_config(["--output_dir", str(tmp_path / "run"), *flags], defaults=train_defaults())


@pytest.mark.parametrize(("flags", "names"), [
    ([], ()), (["--report_to", "none"], ()), (["--report_to", "wandb"], ("wandb",)),
    (["--report_to", "wandb,tensorboard,mlflow"], ("wandb", "tensorboard", "mlflow")),
    (["--report_to", "mlflow, tensorboard"], ("mlflow", "tensorboard")),
    (["--report_to=tensorboard,tensorboard"], ("tensorboard",)),
])
def test_report_to_takes_a_comma_separated_list(parse, flags, names):
    assert parse(*flags).logging.report_to == names


@pytest.mark.parametrize(("value", "names"), [
    ("wandb", ("wandb",)), ("none", ()), (["tensorboard", "mlflow"], ("tensorboard", "mlflow")), (("none",), ()),
])
def test_a_json_config_may_give_a_string_or_a_list(value, names):
    settings = LoggingSettings(report_to=value)  # (an earlier run's run_config.json has "wandb" / "none")
    assert settings.report_to == names and LoggingSettings(report_to=settings.report_to) == settings


@pytest.mark.parametrize(("flags", "message"), [
    (["--report_to", "tensorbaord"], r"--report_to: unknown 'tensorbaord'; pass some of wandb, tensorboard, mlflow"),
    (["--report_to", "wandb,comet"], r"--report_to: unknown 'comet'; pass some of wandb, tensorboard, mlflow"),
    (["--report_to", "none,wandb"], r"--report_to: none means no tracker, yet none,wandb names some"),
])
def test_an_unknown_or_contradictory_tracker_is_refused_naming_the_valid_ones(parse, flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


def test_a_non_list_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--report_to must be a comma-separated list of none, wandb, tensorboard"):
        LoggingSettings(report_to=3)


@pytest.mark.parametrize("name", TRACKERS)
def test_a_missing_package_stops_the_run_before_any_process_group(parse, monkeypatch, name):
    import torch.distributed as dist

    from odb.training.run.loop import Trainer

    config = parse("--report_to", name)
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it raises
    install = {"wandb": "pip install wandb", "tensorboard": "pip install tensorboard",
               "mlflow": "pip install mlflow"}[name]
    with pytest.raises(ModuleNotFoundError, match=rf"--report_to {name} needs the {name} package: {install}"):
        Trainer.init(config)
    assert not dist.is_initialized()
    check_installed([])  # nothing asked for: nothing checked


def test_the_trackers_packages_are_imported_only_when_asked_for():
    probe = ("import sys, odb.training.run.loop, odb.telemetry.trackers; "
             "print([m for m in ('wandb', 'tensorboard', 'mlflow', 'torch.utils.tensorboard') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---- TensorBoard and MLflow, read back -----------------------------------------------------------

def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_client(out):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step,
                                                                                                    m.timestamp))]


@pytest.fixture
def store(monkeypatch):
    """A fresh MLflow environment: odb's defaults (a file store in the output folder, experiment odb)."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "TENSORBOARD_LOGGING_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (this process reads the store back)


def run_part(out, steps: range, *, loss: float, resume: bool, exit_code: int = 0, preempted: bool = False,
             evals: dict[int, float | None] | None = None, superseded: Superseded | None = None) -> Trackers:
    trackers = Trackers(("tensorboard", "mlflow"), RunInfo(output_dir=out, name="tiny-run", params=PARAMS,
                                                           resume=resume, odb_version="9.9"))
    trackers.start(steps.start, log=lambda message: None, superseded=superseded)
    for step in steps:
        trackers.log(step_row(step, loss + step))
        if evals and step in evals:
            trackers.log(eval_row(step, evals[step]))
    if exit_code == 0:
        trackers.record_summary({"steps": steps.stop, "loss_last": loss, "this_process": {"steps": len(steps)},
                                 "policy": "odb", "eval_loss": None, "config": {"lr": 1.0}})
    for tracker in trackers:
        tracker.finish(exit_code, preempted=preempted)
    return trackers


def test_tensorboard_and_mlflow_get_every_number_of_the_rows_at_their_steps(tmp_path, store):
    out = tmp_path / "run"
    out.mkdir()
    run_part(out, range(4), loss=2.0, resume=False, evals={1: 1.5, 3: None})

    scalars = tensorboard_scalars(out / "tensorboard")
    assert [p.name for p in (out / "tensorboard").iterdir()][0].startswith("events.out.tfevents.")
    assert len(list((out / "tensorboard").iterdir())) == 1
    assert scalars["loss"] == [(s, pytest.approx(2.0 + s)) for s in range(4)]
    assert scalars["real_tokens"] == [(s, 900 + s) for s in range(4)]
    assert scalars["skipped/no_labels"] == [(s, s) for s in range(4)]
    assert scalars["eval_loss"] == [(1, 1.5)]  # (the null of step 3 is left out)
    assert scalars["summary/loss_last"] == [(4, 2.0)] and scalars["summary/this_process/steps"] == [(4, 4)]
    assert "step" not in scalars and "time" not in scalars and "summary/policy" not in scalars
    assert not any(tag.startswith("summary/config") for tag in scalars)

    client = mlflow_client(out)
    (experiment,) = [e for e in client.search_experiments() if e.name == "odb"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny-run" and run.info.status == "FINISHED"
    assert run.data.tags["odb.version"] == "9.9" and run.data.tags["odb.output_dir"] == str(out.resolve())
    assert run.data.params == {"world_size": "2", "lr": "0.001", "model": "tiny", "lora": "false",
                               "odb/max_tokens": "512", "odb/policy": "odb", "fsdp2": "null"}  # ("long": too long)
    for key, values in scalars.items():
        assert history(client, run.info.run_id, key) == [(s, pytest.approx(v)) for s, v in values], key
    assert history(client, run.info.run_id, "loss") == [(s, 2.0 + s) for s in range(4)]  # (float64 here)
    timestamps = [m.timestamp for m in client.get_metric_history(run.info.run_id, "loss")]
    assert timestamps == [round(1000 * step_row(s, 0)["time"]) for s in range(4)]
    saved = json.loads((out / RUN_IDS).read_text())
    assert saved["mlflow"]["run_id"] == run.info.run_id and saved["tensorboard"]["log_dir"] == str(out / "tensorboard")


def test_a_resumed_process_continues_the_same_runs_from_its_first_step(tmp_path, store):
    out = tmp_path / "run"
    out.mkdir()
    first = run_part(out, range(5), loss=2.0, resume=False, exit_code=1)  # failed after step 4
    run_id = first.opened["mlflow"].run_id
    client = mlflow_client(out)
    assert client.get_run(run_id).info.status == "FAILED"
    run_part(out, range(3, 7), loss=10.0, resume=True)  # resumed from a checkpoint after step 2

    scalars = tensorboard_scalars(out / "tensorboard")
    # TensorBoard: the earlier process's steps 3 and 4 are hidden (purge_step 3): each step once, the latest
    assert scalars["loss"] == [(0, 2.0), (1, 3.0), (2, 4.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    assert len(list((out / "tensorboard").iterdir())) == 2  # one event file per process, in one folder
    (run,) = client.search_runs([client.get_experiment_by_name("odb").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"  # the same run, RUNNING again, then finished
    # MLflow keeps every value: steps 3 and 4 twice, the earlier process's first
    assert history(client, run_id, "loss") == [(0, 2.0), (1, 3.0), (2, 4.0), (3, 5.0), (3, 13.0), (4, 6.0),
                                               (4, 14.0), (5, 15.0), (6, 16.0)]


def test_steps_an_earlier_process_logged_past_the_checkpoint_are_named_on_the_mlflow_run(tmp_path, store):
    """After a crash the resumed process trains steps 3-4 again (metrics.jsonl moved the earlier rows
    aside): TensorBoard hides the earlier values (purge_step), MLflow keeps them and its run's tag
    names the steps, each crash's in turn."""
    out = tmp_path / "run"
    out.mkdir()
    run_id = run_part(out, range(5), loss=2.0, resume=False, exit_code=1).opened["mlflow"].run_id
    run_part(out, range(3, 7), loss=10.0, resume=True, exit_code=1, superseded=Superseded(rows=2, first=3, last=4))
    client = mlflow_client(out)
    assert client.get_run(run_id).data.tags["odb.superseded_steps"] == "3-4"
    run_part(out, range(5, 8), loss=20.0, resume=True, superseded=Superseded(rows=2, first=5, last=6))
    assert client.get_run(run_id).data.tags["odb.superseded_steps"] == "3-4, 5-6"
    assert [s for s, _ in history(client, run_id, "loss")] == [0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7]
    assert tensorboard_scalars(out / "tensorboard")["loss"] == [(0, 2.0), (1, 3.0), (2, 4.0), (3, 13.0), (4, 14.0),
                                                                (5, 25.0), (6, 26.0), (7, 27.0)]


def test_a_resume_with_another_tracking_uri_starts_a_new_mlflow_run(tmp_path, store, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    run_part(out, range(2), loss=1.0, resume=False, exit_code=75, preempted=True)
    first = json.loads((out / RUN_IDS).read_text())["mlflow"]
    assert mlflow_client(out).get_run(first["run_id"]).info.status == "KILLED"  # stopped on request
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other.resolve().as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    run_part(out, range(2, 4), loss=1.0, resume=True)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=other.resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    assert run.info.run_id != first["run_id"] and history(client, run.info.run_id, "loss") == [(2, 3.0), (3, 4.0)]


def test_without_trackers_nothing_is_opened_or_written(tmp_path):
    trackers = Trackers((), RunInfo(output_dir=tmp_path, name="x", params={}))
    trackers.start(0)
    trackers.log(step_row(0, 1.0))
    assert not trackers and list(trackers) == [] and list(tmp_path.iterdir()) == []


# ---- the output folder and the environment -------------------------------------------------------

def test_overwrite_output_dir_starts_the_trackers_over_too(tmp_path, store, parse):
    """--overwrite_output_dir removed the earlier run's metrics.jsonl and checkpoints but left its
    tensorboard/, mlruns/ and trackers.json: the fresh run's TensorBoard folder held the earlier
    run's event file, MLflow's store its run beside the new one (and a fresh run that failed before
    its trackers opened left trackers.json for a later --resume to continue the old runs). Read back
    with TensorBoard's and MLflow's own readers, the fresh run's trackers now hold it alone."""
    out = tmp_path / "run"
    out.mkdir()
    run_part(out, range(4), loss=2.0, resume=False, evals={1: 1.5})
    (out / "metrics.jsonl").write_text(json.dumps(step_row(0, 2.0)) + "\n")
    assert {"tensorboard", "mlruns", RUN_IDS} <= {p.name for p in out.iterdir()}
    parse("--overwrite_output_dir")
    assert not [p.name for p in out.iterdir()]
    # the fresh run, in a process of its own as a run is (MLflow keeps a file store's state per
    # process: this one's still knows the removed store)
    proc = subprocess.run([sys.executable, "-c", FRESH_RUN, str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((out / "tensorboard").iterdir())) == 1
    scalars = tensorboard_scalars(out / "tensorboard")
    assert scalars["loss"] == [(0, 5.0), (1, 6.0)] and "eval_loss" not in scalars
    client = mlflow_client(out)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    fresh = json.loads((out / RUN_IDS).read_text())["mlflow"]["run_id"]
    assert [(r.info.run_id, r.info.run_name) for r in runs] == [(fresh, "fresh")]
    assert history(client, fresh, "loss") == [(0, 5.0), (1, 6.0)]


FRESH_RUN = """
import sys
from pathlib import Path
from odb.telemetry.trackers import RunInfo, Trackers
trackers = Trackers(("tensorboard", "mlflow"), RunInfo(output_dir=Path(sys.argv[1]), name="fresh", params={}))
trackers.start(0, log=print)
for step in range(2):
    trackers.log({"step": step, "time": 1_700_000_000.0 + step, "loss": 5.0 + step})
for tracker in trackers:
    tracker.finish(0)
"""


def test_mlflow_run_id_names_the_run_to_continue(tmp_path, store, monkeypatch):
    """MLFLOW_RUN_ID was not read: a user who named the run to continue (MLflow's own start_run
    continues it) got a new run. Now it is that run, over a resume's saved one too."""
    out = tmp_path / "run"
    out.mkdir()
    client = mlflow_client(out)  # (odb's default store: OUTPUT_DIR/mlruns)
    experiment = client.create_experiment("mine")
    mine, other = (client.create_run(experiment, run_name=name).info.run_id for name in ("mine", "other"))
    client.set_terminated(mine, status="KILLED")
    monkeypatch.setenv("MLFLOW_RUN_ID", mine)
    messages = []
    trackers = Trackers(("mlflow",), RunInfo(output_dir=out, name="tiny-run", params=PARAMS, odb_version="9.9"))
    trackers.start(0, log=messages.append)
    assert client.get_run(mine).info.status == "RUNNING"
    assert messages == [f"odb: MLflow: continuing run {mine} (MLFLOW_RUN_ID) from step 0"]
    for step in range(3):
        trackers.log(step_row(step, 1.0 + step))
    trackers.opened["mlflow"].finish(0)
    assert history(client, mine, "loss") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert client.get_run(mine).info.status == "FINISHED" and client.get_run(mine).data.params["model"] == "tiny"
    assert client.get_experiment_by_name("odb") is None  # no run of odb's own
    assert json.loads((out / RUN_IDS).read_text())["mlflow"]["run_id"] == mine

    monkeypatch.setenv("MLFLOW_RUN_ID", other)  # a resume whose trackers.json names `mine`
    run_part(out, range(2, 4), loss=10.0, resume=True)
    assert history(client, other, "loss") == [(2, 12.0), (3, 13.0)]
    assert history(client, mine, "loss") == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_an_mlflow_run_id_the_store_does_not_hold_is_refused_naming_the_fix(tmp_path, store, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    mlflow_client(out).create_experiment("odb")  # (the store exists; the run does not)
    monkeypatch.setenv("MLFLOW_RUN_ID", "0123456789abcdef0123456789abcdef")
    trackers = Trackers(("mlflow",), RunInfo(output_dir=out, name="tiny-run", params=PARAMS))
    with pytest.raises(ValueError, match=r"MLFLOW_RUN_ID 0123456789abcdef0123456789abcdef: no such run in the "
                                         r"MLflow tracking store file:.*mlruns \(RESOURCE_DOES_NOT_EXIST\): set "
                                         r"MLFLOW_TRACKING_URI to the store that holds it, or unset MLFLOW_RUN_ID"):
        trackers.start(0, log=lambda message: None)


@pytest.mark.parametrize(("flag", "env", "project"), [
    ("mine", "theirs", "mine"), (None, "theirs", "theirs"), (None, None, "odb"), (None, "", "odb"),
])
def test_the_wandb_project_is_the_flag_else_wandb_project_else_odb(monkeypatch, parse, flag, env, project):
    """The SLURM docs' `export WANDB_PROJECT=...` did nothing: --wandb_project's default (odb) was
    always passed to wandb.init, over the variable. The real W&B run's project:
    tests/e2e/test_trackers_env.py."""
    if env is None:
        monkeypatch.delenv("WANDB_PROJECT", raising=False)
    else:
        monkeypatch.setenv("WANDB_PROJECT", env)
    config = parse(*(["--wandb_project", flag] if flag else []))
    assert config.logging.wandb_project == flag
    assert wandb_project(config.logging.wandb_project) == project
