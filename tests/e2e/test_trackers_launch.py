"""--report_to wandb,tensorboard,mlflow on a launched 2-rank run, stopped after 3 steps (its
checkpoint after 2) and resumed: each tracker, read back with its own reader (TensorBoard's
EventAccumulator, MLflow's client, the offline W&B files), holds what metrics.jsonl holds, in one
run per job, the resumed process continuing it; the first process's rows of step 2, which the
resumed process trains again, are in metrics.superseded.jsonl, hidden in TensorBoard, kept in
MLflow and W&B. The oracle is metrics.jsonl as odb wrote it.
(Parsing, errors and the trackers in one process: tests/unit/test_trackers.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import deepspeed, ds_config, odb_config
from wandb_offline import offline_histories, offline_summaries

SAVED, STOPPED = 2, 3  # the first process saves a checkpoint after 2 steps and stops after 3
NAME = "odb-trackers"


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """The (step, value) points of ``key`` in ``rows``, in step order (then as written)."""
    return sorted(((r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))),
                  key=lambda point: point[0])


def tensorboard(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def mlflow_runs(out: Path) -> list[dict]:
    """Every run of the experiment odb in the run's own store, as plain data (read in this process,
    which needs MLflow 3's opt-in to file stores, as odb gives its ranks)."""
    from mlflow import MlflowClient

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
        experiments = client.search_experiments()
        runs = [run for e in experiments for run in client.search_runs([e.experiment_id])]
        return [{"id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
                 "experiment": next(e.name for e in experiments if e.experiment_id == run.info.experiment_id),
                 "params": run.data.params, "tags": run.data.tags,
                 "history": {key: sorted(((m.step, m.timestamp, m.value) for m in
                                          client.get_metric_history(run.info.run_id, key)))
                             for key in run.data.metrics}} for run in runs]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The two processes of one job: what the trackers held after the first, and after the resume."""
    tmp = tmp_path_factory.mktemp("trackers")
    out = tmp / "run"
    flags = ["--deepspeed_config", str(ds_config(tmp, 2)),
             "--odb_config", str(odb_config(tmp, max_tokens=256, window=16, gas=2)),
             "--max_samples", "64", "--val_ratio", "0.1", "--eval_steps", "2", "--output_dir", str(out),
             "--no_final_checkpoint", "--report_to", "wandb,tensorboard,mlflow", "--run_name", NAME]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TENSORBOARD_LOGGING_DIR", "WANDB_RUN_ID"):
            env.delenv(name, raising=False)
        deepspeed([*flags, "--max_steps", str(STOPPED), "--save_steps", str(SAVED)])
        first = {"rows": metrics(out), "tensorboard": tensorboard(out), "mlflow": mlflow_runs(out),
                 "summary": json.loads((out / "summary.json").read_text()),
                 "event_files": sorted(p.relative_to(out) for p in out.rglob("events.out.tfevents.*"))}
        deepspeed([*flags, "--resume"])
    return out, first


def test_the_first_process_logs_its_rows_to_one_run_of_each_tracker(job):
    out, first = job
    rows = first["rows"]
    assert max(r["step"] for r in rows) == STOPPED - 1 and any("eval_loss" in r for r in rows)
    assert first["event_files"] == [first["event_files"][0]] and first["event_files"][0].parent == Path("tensorboard")
    (run,) = first["mlflow"]  # rank 0 alone: one run for 2 ranks
    assert (run["experiment"], run["name"], run["status"]) == ("odb", NAME, "FINISHED")
    for key in ("loss", "lr", "tokens_per_s", "padding_ratio", "budget_fill", "sync_efficiency", "eval_loss"):
        expected = series(rows, key)
        assert expected, key
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in expected] == first["tensorboard"][key], key
        assert [(s, v) for s, _, v in run["history"][key]] == expected, key
    config = first["summary"]["config"]
    assert run["params"]["world_size"] == "2" and run["params"]["odb/max_tokens"] == "256"
    assert json.loads(run["params"]["lr"]) == config["optimization"]["lr"] and run["params"]["policy"] == "odb"
    assert run["tags"]["mlflow.runName"] == NAME and run["tags"]["odb.output_dir"] == str(out.resolve())
    assert [(s, v) for s, _, v in run["history"]["summary/steps"]] == [(STOPPED, STOPPED)]
    assert first["tensorboard"]["summary/steps"] == [(STOPPED, STOPPED)]


def test_the_resumed_process_continues_each_run_where_its_checkpoint_left_off(job):
    out, first = job
    rows = metrics(out)
    earlier = [r for r in first["rows"] if r["step"] < SAVED]  # (its third step is trained again)
    assert rows[:len(earlier)] == earlier and min(r["step"] for r in rows[len(earlier):]) == SAVED
    resumed = rows[len(earlier):]
    superseded = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [r for r in first["rows"] if r["step"] >= SAVED]
    summary = json.loads((out / "summary.json").read_text())
    assert max(r["step"] for r in resumed) == summary["steps"] - 1 > STOPPED

    # TensorBoard: one folder, a file per process; the earlier process's rows from the checkpoint's
    # step on are hidden (purge_step), so each step shows the value that the run kept
    files = sorted(out.rglob("events.out.tfevents.*"))
    assert len(files) == 2 and {f.parent for f in files} == {out / "tensorboard"}
    scalars = tensorboard(out)
    for key in ("loss", "lr", "real_tokens", "sync_efficiency", "eval_loss"):
        assert scalars[key] == [(s, pytest.approx(v, rel=1e-6)) for s, v in series(rows, key)], key
    assert scalars["summary/steps"] == [(summary["steps"], summary["steps"])]  # (the first process's: hidden)

    # MLflow: the same run, finished again, every value logged (the step trained twice has two
    # points), its tag naming the steps superseded
    (run,) = mlflow_runs(out)
    both = first["rows"] + resumed
    assert run["id"] == first["mlflow"][0]["id"] and run["status"] == "FINISHED"
    assert run["tags"]["odb.superseded_steps"] == f"{SAVED}-{STOPPED - 1}"
    assert [(s, t, v) for s, t, v in run["history"]["loss"]] == sorted(
        (r["step"], round(1000 * r["time"]), r["loss"]) for r in both if "loss" in r)
    assert [(s, v) for s, _, v in run["history"]["eval_loss"]] == series(both, "eval_loss")
    saved = json.loads((out / "trackers.json").read_text())
    assert saved["mlflow"]["run_id"] == run["id"]

    # W&B (offline): a run folder per process, the same run id, each with its process's rows
    folders = sorted((out / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and {f.name.rsplit("-", 1)[1] for f in folders} == {saved["wandb"]["id"]}
    for history, written in zip(offline_histories(out), (first["rows"], resumed), strict=True):
        assert len(history) == len(written)  # every row, the evaluations too, charted over its step
        for logged, row in zip(history, written):
            for key, value in row.items():
                if not isinstance(value, dict):
                    assert logged[key] == pytest.approx(value), (row["step"], key)
    summaries = offline_summaries(out)  # the resumed process names the steps it trains again
    assert "superseded_steps" not in summaries[0] and summaries[1]["superseded_steps"] == f"{SAVED}-{STOPPED - 1}"
