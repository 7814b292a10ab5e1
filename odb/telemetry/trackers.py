"""Rank 0's experiment trackers: W&B, TensorBoard and MLflow behind one small interface.

``metrics.jsonl`` is the run's record; each tracker gets the same rows as they are written (the
:class:`~odb.telemetry.Telemetry` sink is :meth:`Trackers.log`), the run's summary at its end
(:meth:`Trackers.record_summary`) and how the process ended (:meth:`Tracker.finish`). Only rank 0
has trackers, so a job is one tracker run whatever its number of ranks or nodes. A tracker's
package is imported only when ``--report_to`` names it; :func:`check_installed` makes a missing
one an error at start, on every rank, before any process group.

What each receives of a row: W&B the row as it is (a history row per row, charted over its
``step``); TensorBoard and MLflow its numbers (:func:`numeric_fields`) by their ``metrics.jsonl``
names at the row's ``step`` (a nested figure as ``parent/child``: ``skipped/no_labels``), the
row's ``time`` as the event's time; a null (``eval_loss`` of an eval set without labels) is left
out. The summary's numbers go to TensorBoard and MLflow as ``summary/<name>`` at the run's step
count (:func:`summary_fields`), to W&B as its run summary.

A resumed process (``--resume``) continues the runs of the process it resumes where the tracker
allows it. :meth:`Trackers.start` opens them once the checkpoint has loaded, at the run's first
step in this process. Where an earlier process logged steps past that checkpoint (it died without
saving: the rows ``metrics.jsonl`` moves aside, :mod:`odb.telemetry.writer`), each tracker is told
(:meth:`Tracker.supersede`):

* W&B: the run id saved in ``OUTPUT_DIR/trackers.json``, ``resume="allow"`` (offline: a second
  offline run folder with the same id, which ``wandb sync`` appends to it), unless ``WANDB_RUN_ID``
  names another. Its charts are over the rows' ``step``. W&B keeps every history row: its rewind
  (``resume_from``) is a private preview for online runs whose ``_step`` is the chart's axis, not
  odb's ``step``; so a step trained again after a crash has two points, and the run's summary says
  which steps (``superseded_steps``).
* TensorBoard: the same log folder, ``purge_step`` at the first step: TensorBoard hides what an
  earlier process wrote from that step on (the steps trained again, the earlier summary).
* MLflow: the run id saved in ``trackers.json`` (where the tracking URI is the same), set back to
  RUNNING, unless ``MLFLOW_RUN_ID`` names another. MLflow has no call that removes a logged value,
  so a step trained again after a crash has two points (the later timestamp the resumed
  process's); the run's tag ``odb.superseded_steps`` says which steps.

The environment a tracker's own clients read: ``WANDB_PROJECT`` (under ``--wandb_project``),
``WANDB_RUN_ID`` and W&B's other variables; ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``,
``MLFLOW_RUN_ID``; ``TENSORBOARD_LOGGING_DIR`` (as the Hugging Face Trainer reads it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from odb.telemetry.writer import Superseded

__all__ = ["RUN_IDS", "TRACKERS", "RunInfo", "Tracker", "Trackers", "check_installed", "numeric_fields",
           "summary_fields", "wandb_project"]

TRACKERS = ("wandb", "tensorboard", "mlflow")
"""What ``--report_to`` may name (besides ``none``)."""
_PACKAGES = {"wandb": ("wandb", "pip install wandb"), "tensorboard": ("tensorboard", "pip install tensorboard"),
             "mlflow": ("mlflow", "pip install mlflow (or mlflow-skinny)")}
"""Each tracker's module, and the command that installs it."""
RUN_IDS = "trackers.json"
"""In the output folder: what a resumed process needs to continue rank 0's tracker runs."""
MAX_PARAM_CHARS = 500
"""A longer setting is not an MLflow parameter (it is in ``summary.json``'s config): MLflow refuses
a value over its limit (6000 characters in MLflow 3, less in older releases)."""


def check_installed(names: Iterable[str]) -> None:
    """Raises ``ModuleNotFoundError`` naming the install command of the first tracker in ``names``
    whose package is missing; imports nothing (every rank calls it at start, before any process
    group, so a run fails at once instead of on rank 0 after the model has loaded)."""
    for name in names:
        module, install = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"--report_to {name} needs the {module} package: {install}, or "
                                      f"pip install 'odb[{name}]'; or drop {name} from --report_to")


def numeric_fields(row: Mapping[str, Any], *, skip: Iterable[str] = ("step", "time")) -> dict[str, float]:
    """The numbers of a metrics row by name, nested mappings flattened as ``parent/child``;
    ``skip``: top-level names that are not figures (the step and the time each event carries);
    booleans, strings, lists and nulls are left out."""
    return _flat({k: v for k, v in row.items() if k not in skip})


def summary_fields(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's numbers as ``summary/<name>`` (its config is the run's parameters)."""
    return _flat({k: v for k, v in summary.items() if k != "config"}, prefix="summary/")


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, prefix=f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What the trackers are told of the run when it starts."""

    output_dir: Path
    name: str
    """The run's name in every tracker (``--run_name``)."""
    params: Mapping[str, Any]
    """The effective settings: W&B's config, MLflow's parameters (flattened)."""
    resume: bool = False
    """This process continues an earlier one's run (``--resume``): reuse its saved tracker runs."""
    wandb_project: str | None = None
    """``--wandb_project`` (None: :func:`wandb_project`'s choice)."""
    wandb_tags: tuple[str, ...] = ()
    odb_version: str = ""


class Tracker(Protocol):
    """One tracker's run, opened by :meth:`Trackers.start` (rank 0)."""

    title: str
    """Its name in messages ("W&B")."""
    saved: dict[str, Any]
    """What :data:`RUN_IDS` keeps of it for a resumed process."""

    def log(self, row: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` row, at its ``step``."""

    def record_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's ``summary.json`` (successful runs only)."""

    def finish(self, exit_code: int = 0, *, preempted: bool = False) -> None:
        """Ends the run: finished (0), stopped on request to be resumed (``preempted``), or failed."""

    def supersede(self, steps: str) -> None:
        """A resumed process trains ``steps`` (``"K-L"``) again: an earlier process logged them."""


class Trackers:
    """The trackers ``names`` of rank 0's run (no names: no tracker, nothing imported).

    Built with the other components, the sink of the telemetry from then on; :meth:`start` opens
    the runs once the run knows its first step (a resume's checkpoint loaded), before any row.
    """

    def __init__(self, names: Sequence[str], run: RunInfo) -> None:
        self.names, self.run = tuple(names), run
        self.opened: dict[str, Tracker] = {}  # by name, from start() on

    def __bool__(self) -> bool:
        return bool(self.names)

    def __iter__(self) -> Iterator[Tracker]:
        return iter(self.opened.values())

    def start(self, first_step: int, log: Callable[[str], None] = print, *,
              superseded: Superseded | None = None) -> None:
        """Opens each tracker's run at ``first_step`` (this process's first: 0, or a resume's
        checkpoint step) and saves what a resumed process needs in :data:`RUN_IDS`; ``superseded``:
        the rows of later steps an earlier process wrote (:meth:`Tracker.supersede`)."""
        if not self.names:
            return
        saved = self._saved(log) if self.run.resume else {}
        for name in self.names:
            self.opened[name] = _OPEN[name](self.run, saved.get(name), first_step, log)
            if superseded is not None and superseded.steps is not None:
                self.opened[name].supersede(superseded.steps)
        ids = {**saved, **{name: tracker.saved for name, tracker in self.opened.items()}}  # (one left out now: kept)
        (self.run.output_dir / RUN_IDS).write_text(json.dumps(ids, indent=2) + "\n")

    def log(self, row: Mapping[str, Any]) -> None:
        for tracker in self:
            tracker.log(row)

    def record_summary(self, summary: Mapping[str, Any]) -> None:
        for tracker in self:
            tracker.record_summary(summary)

    def _saved(self, log: Callable[[str], None]) -> dict[str, Any]:
        path = self.run.output_dir / RUN_IDS
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            log(f"odb: no tracker runs to continue ({path}: {type(err).__name__}): new runs")
            return {}
        return saved if isinstance(saved, dict) else {}


# ---- W&B -----------------------------------------------------------------------------------------

def wandb_project(flag: str | None) -> str:
    """The W&B project: ``--wandb_project``, else the environment's ``WANDB_PROJECT`` (as W&B's own
    clients read it), else ``odb``."""
    return flag or os.environ.get("WANDB_PROJECT") or "odb"


class WandbTracker:
    """A W&B run (``wandb.init`` in ``OUTPUT_DIR/wandb``); ``WANDB_MODE=offline`` works."""

    title = "W&B"

    def __init__(self, run: RunInfo, saved: Mapping[str, Any] | None, first_step: int,
                 log: Callable[[str], None]) -> None:
        import wandb  # only when asked for

        # a resume continues the saved run (unless WANDB_RUN_ID names one: the user's choice wins)
        resume = {"id": saved["id"], "resume": "allow"} if saved and saved.get("id") and \
            not os.environ.get("WANDB_RUN_ID") else {}
        self.run = wandb.init(project=wandb_project(run.wandb_project), name=run.name, tags=list(run.wandb_tags),
                              dir=str(run.output_dir), **resume)
        # (after init: a resumed run's config may differ, e.g. its world size, which W&B allows only so)
        self.run.config.update(dict(run.params), allow_val_change=True)
        # charts over the rows' own step: W&B's _step only grows, and an evaluation's row comes after
        # the rows of later steps of its round (and a resume repeats steps), which log(step=) would drop
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.saved = {"id": self.run.id}
        if resume:
            log(f"odb: W&B: continuing run {self.run.id} from step {first_step}")

    def log(self, row: Mapping[str, Any]) -> None:
        self.run.log(dict(row))  # (a copy: the next tracker gets the row as written)

    def record_summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(dict(summary))

    def finish(self, exit_code: int = 0, *, preempted: bool = False) -> None:
        if preempted:
            self.run.mark_preempting()  # W&B shows the run as preempted, to be resumed
        self.run.finish(exit_code=exit_code)

    def supersede(self, steps: str) -> None:
        earlier = self.run.summary.get("superseded_steps")  # (an online run's earlier resumes)
        self.run.summary["superseded_steps"] = f"{earlier}, {steps}" if earlier else steps


# ---- TensorBoard ---------------------------------------------------------------------------------

class TensorBoardTracker:
    """TensorBoard event files in ``TENSORBOARD_LOGGING_DIR`` (as the Hugging Face Trainer reads
    it), else ``OUTPUT_DIR/tensorboard``, through ``torch.utils.tensorboard.SummaryWriter``."""

    title = "TensorBoard"

    def __init__(self, run: RunInfo, saved: Mapping[str, Any] | None, first_step: int,
                 log: Callable[[str], None]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # only when asked for (needs tensorboard)

        self.log_dir = Path(os.environ.get("TENSORBOARD_LOGGING_DIR") or run.output_dir / "tensorboard").expanduser()
        # purge_step: TensorBoard hides the events an earlier process wrote here from first_step on
        # (a fresh run's 0: an earlier run's, in a folder --overwrite_output_dir left)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=first_step)
        self.saved = {"log_dir": str(self.log_dir)}

    def log(self, row: Mapping[str, Any]) -> None:
        self._add(numeric_fields(row), step=row["step"], walltime=row.get("time"))

    def record_summary(self, summary: Mapping[str, Any]) -> None:
        self._add(summary_fields(summary), step=summary["steps"], walltime=None)

    def _add(self, figures: Mapping[str, float], *, step: int, walltime: float | None) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=walltime)
        self.writer.flush()  # (a run that fails later still shows its steps)

    def finish(self, exit_code: int = 0, *, preempted: bool = False) -> None:
        self.writer.close()

    def supersede(self, steps: str) -> None:
        """Nothing to do: ``purge_step`` hides the earlier process's events of those steps."""


# ---- MLflow --------------------------------------------------------------------------------------

class MlflowTracker:
    """An MLflow run, through the client API (no global active run): the tracking URI from
    ``MLFLOW_TRACKING_URI``, else a local file store in ``OUTPUT_DIR/mlruns``; the run
    ``MLFLOW_RUN_ID`` names (continued, as MLflow's ``start_run`` does), else a resume's saved one,
    else a new one in the experiment ``MLFLOW_EXPERIMENT_NAME``, else ``odb``. MLflow 3 refuses a
    file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true: odb sets it for its own default (not for
    a URI you name)."""

    title = "MLflow"
    MAX_PARAMS = 100  # parameters per log_batch call (MLflow's limit)
    SUPERSEDED_TAG = "odb.superseded_steps"  # the steps an earlier process logged and this one trains again

    def __init__(self, run: RunInfo, saved: Mapping[str, Any] | None, first_step: int,
                 log: Callable[[str], None]) -> None:
        from mlflow import MlflowClient  # only when asked for
        from mlflow.entities import Metric, Param

        self._metric, uri = Metric, os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run.output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        named = os.environ.get("MLFLOW_RUN_ID")  # (the user's choice wins, as with MLflow's own start_run)
        self.run_id = self._named(named, uri, first_step, log) if named else \
            self._continued(saved, uri, first_step, log) or self._created(run)
        logged = self.client.get_run(self.run_id).data.params  # (a resumed run's: MLflow refuses to change one)
        params = [Param(k, v) for k, v in _params(run.params).items() if k not in logged]
        for i in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_PARAMS])
        self.saved = {"tracking_uri": uri, "run_id": self.run_id}

    def _continued(self, saved: Mapping[str, Any] | None, uri: str, first_step: int,
                   log: Callable[[str], None]) -> str | None:
        """The saved run's id where it is in this tracking store (set RUNNING again), else None."""
        if not saved or saved.get("tracking_uri") != uri or not saved.get("run_id"):
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(saved["run_id"])
        except MlflowException as err:
            log(f"odb: MLflow: cannot continue run {saved['run_id']} ({err.error_code}): a new run")
            return None
        self.client.update_run(saved["run_id"], status="RUNNING")
        log(f"odb: MLflow: continuing run {saved['run_id']} from step {first_step}")
        return saved["run_id"]

    def _named(self, run_id: str, uri: str, first_step: int, log: Callable[[str], None]) -> str:
        """The run ``MLFLOW_RUN_ID`` names, set RUNNING again; raises ``ValueError`` naming the fix
        where this tracking store has no such run."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as err:
            raise ValueError(f"MLFLOW_RUN_ID {run_id}: no such run in the MLflow tracking store {uri} "
                             f"({err.error_code}): set MLFLOW_TRACKING_URI to the store that holds it, or unset "
                             "MLFLOW_RUN_ID for a new run") from err
        self.client.update_run(run_id, status="RUNNING")
        log(f"odb: MLflow: continuing run {run_id} (MLFLOW_RUN_ID) from step {first_step}")
        return run_id

    def _created(self, run: RunInfo) -> str:
        from mlflow.exceptions import MlflowException

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "odb"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(name)
            except MlflowException:  # another job created it just now
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        tags = {"odb.version": run.odb_version, "odb.output_dir": str(run.output_dir.resolve())}
        return self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id

    def log(self, row: Mapping[str, Any]) -> None:
        self._log(numeric_fields(row), step=row["step"], seconds=row.get("time"))

    def record_summary(self, summary: Mapping[str, Any]) -> None:
        self._log(summary_fields(summary), step=summary["steps"], seconds=None)

    def _log(self, figures: Mapping[str, float], *, step: int, seconds: float | None) -> None:
        timestamp = round(1000 * (seconds if seconds is not None else time.time()))
        self.client.log_batch(self.run_id, metrics=[self._metric(name, value, timestamp, step)
                                                    for name, value in figures.items()])

    def finish(self, exit_code: int = 0, *, preempted: bool = False) -> None:
        status = "FINISHED" if exit_code == 0 else "KILLED" if preempted else "FAILED"
        self.client.set_terminated(self.run_id, status=status)

    def supersede(self, steps: str) -> None:
        earlier = self.client.get_run(self.run_id).data.tags.get(self.SUPERSEDED_TAG)
        self.client.set_tag(self.run_id, self.SUPERSEDED_TAG, f"{earlier}, {steps}" if earlier else steps)


def _params(settings: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The settings as MLflow parameters: nested mappings flattened as ``parent/child``, values as
    JSON (strings as they are), those longer than :data:`MAX_PARAM_CHARS` left out."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_params(value, prefix=f"{name}/"))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) <= MAX_PARAM_CHARS:
            out[name] = text
    return out


_OPEN: dict[str, Callable[..., Tracker]] = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker,
                                            "mlflow": MlflowTracker}
assert set(_OPEN) == set(TRACKERS) == set(_PACKAGES)
