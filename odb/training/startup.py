"""Before any rank waits on another: what this rank will run, checked; and waits that say what they wait for.

:func:`check_startup` runs in ``launch/train.py`` after the flags are parsed and before the process
group (``Trainer.init``). It stops the rank with :class:`StartupError`, naming what to install, when

* torch is older than :data:`TORCH_FLOOR` (setup.py's floor, which says why);
* the chosen backend needs torch APIs this install lacks (its module's ``TORCH_NEEDS``);
* the model mixes tokens other than by attention (a state-space, linear-attention or short-convolution
  layer), so packed samples would leak into each other: :func:`odb.training.support.packing_refusal`,
  on the model's skeleton (its config on the ``meta`` device, no weights read);
* ranks span nodes under ``torchrun --max-restarts`` (each node's agent counts its own restarts, so
  the ranks of one attempt would disagree on its store keys: :func:`check_restarts`);
* odb's packed attention cannot run on this rank's device in the run's precision:
  :func:`odb.training.attention.attention_path` probes it once (on CUDA: one tiny packed call, checked)
  and names it; the start banner shows that name (:func:`probed_attention`).

A failed check is local to the rank and early: no rank is left waiting for it in a collective.

:func:`announced_wait` wraps each wait before the first step that can take long: the rendezvous
(with DeepSpeed, its CPU ops' build first), the model load and backend set-up. While the wrapped
code runs, a daemon thread prints, every :data:`WAIT_REPORT_ENV` seconds (default 30)::

    odb: rank 1: waiting 60 s for the other ranks to join the process group (...); check ...

and watches for the one wait that never ends by itself: torch's C++ extension build lock. torch's
``cpp_extension.load`` (DeepSpeed builds its ops with it) lets one process build while every other
waits, polling without limit, until the builder deletes ``<build folder>/lock``. A build killed
while it held the lock leaves the file behind, and every later launch on that cache waits for ever
with no output. When the waiting thread is inside that wait (its stack shows torch's ``FileBaton.wait``),
the report names the lock; once no build has run there for the run's ``--dist_timeout_s`` (no
process on this machine works in the build folder, and nothing in it changed), the rank ends (exit
code :data:`odb.training.faults.EXIT_STALLED`) naming the file to delete. The other waits (the
rendezvous, bounded by the process group's own timeout; a model load) are only reported.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import FrameType

import torch

from odb.training import backends
from odb.training.config import RunConfig
from odb.training.faults import EXIT_STALLED

__all__ = ["TORCH_FLOOR", "WAIT_REPORT_ENV", "StartupError", "announced_wait", "check_packing",
           "check_restarts", "check_sequence_parallel", "check_startup", "check_torch", "probed_attention",
           "rank_device", "run_dtype", "torch_version"]

TORCH_FLOOR = (2, 6)
"""The oldest torch odb supports (setup.py states the same, with the reasons)."""
WAIT_REPORT_ENV = "ODB_WAIT_REPORT_S"
"""Seconds between two reports of a wait (default 30); tests set less."""
class StartupError(RuntimeError):
    """This rank cannot run the configuration; the message names the fix."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch's), e.g. ``'2.6.0+cu124'`` -> (2, 6)."""
    major, minor, *_ = (version or torch.__version__).split("+")[0].split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _resolve(dotted: str):
    """The module or attribute ``dotted`` names (``a.b.C``), or None where it does not exist."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name, None)
            if found is None:
                return None
        return found
    return None


def _has(owner, name: str) -> bool:
    fields = getattr(owner, "__dataclass_fields__", None)  # (a dataclass's fields without defaults are no attributes)
    return hasattr(owner, name) or (fields is not None and name in fields)


def check_torch(backend: str) -> None:
    """Raises :class:`StartupError` naming the torch to install when this one is older than
    :data:`TORCH_FLOOR` or lacks what ``backend`` uses (its module's ``TORCH_NEEDS``)."""
    floor = ".".join(map(str, TORCH_FLOOR))
    if torch_version() < TORCH_FLOOR:
        raise StartupError(f"odb needs torch >= {floor} (transformers 5.2x refuses older torch; FSDP2's fully_shard "
                           f"is public from 2.6), found {torch.__version__}: pip install 'torch>={floor}' (the build "
                           "for your CUDA, https://pytorch.org/get-started/locally)")
    if not torch.distributed.is_available():
        raise StartupError(f"this torch build ({torch.__version__}) has no torch.distributed: install a standard "
                           "torch build (pip install torch)")
    chosen = backends.get(backend)
    missing = [f"{owner}.{name}" for owner, names in chosen.TORCH_NEEDS
               for name in names if (found := _resolve(owner)) is None or not _has(found, name)]
    if missing:
        others = " or ".join(f"--backend {name}" for name in backends.NAMES if name != backend)
        raise StartupError(f"--backend {backend} needs {', '.join(missing)}, which torch {torch.__version__} lacks: "
                           f"pip install 'torch>={chosen.TORCH_FLOOR}', or train with {others}")


def rank_device() -> torch.device:
    """The device this rank will train on: its GPU (``LOCAL_RANK``) where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_dtype(config: RunConfig) -> torch.dtype:
    """The precision the model computes in, as the run's backend sets it."""
    return backends.get(config.optimization.backend).compute_dtype(config.optimization)


@lru_cache(maxsize=4)
def _attention_path(device: torch.device, dtype: torch.dtype) -> str:
    from odb.training.attention import attention_path

    return attention_path(device, dtype)


def probed_attention(config: RunConfig) -> str:
    """The packed attention path this rank runs (probed once, by :func:`check_startup`), for the banner.

    Raises:
        StartupError: the path cannot run; the message names the torch or flash-attn to install.
    """
    device, dtype = rank_device(), run_dtype(config)
    try:
        return "odb_varlen: " + _attention_path(device, dtype)
    except RuntimeError as error:
        raise StartupError(f"packed attention cannot run on {device} in {str(dtype).removeprefix('torch.')}: "
                           f"{error}") from error


def check_packing(config: RunConfig, model=None) -> None:
    """Raises :class:`StartupError` where odb cannot pack the run's model exactly (the reason names its
    layers): :func:`odb.training.support.packing_refusal` on the model's skeleton (``model``, or
    built here)."""
    from odb.training.support import packing_refusal, skeleton

    refusal = packing_refusal(model if model is not None else skeleton(config.model.path))
    if refusal is not None:
        raise StartupError(refusal)


def check_sequence_parallel(config: RunConfig, model, env=os.environ) -> None:
    """Raises :class:`StartupError` where ``--sequence_parallel_size`` cannot run: a size that does not
    divide the launch's ranks (``WORLD_SIZE``) or the model's heads, or a vision model
    (:func:`odb.training.sequence_parallel.check_model`, on the skeleton ``model``): before the
    weights load, not after. The same for over_cap 'sequence_parallel''s groups."""
    from odb.training.sequence_parallel import check_model, long_sample_degrees

    size = config.model.sequence_parallel_size
    world = int(env.get("WORLD_SIZE", "1"))
    if config.batching.over_cap == "sequence_parallel":  # (per micro-batch)
        if size > 1:
            raise StartupError("--over_cap sequence_parallel shares long samples between ranks per micro-batch, and "
                               "--sequence_parallel_size splits every row: use one of them")
        try:
            long_sample_degrees(model, config.batching.max_sp, world)
        except ValueError as error:
            raise StartupError(str(error)) from None
    if size == 1:
        return
    if world % size:
        raise StartupError(f"--sequence_parallel_size {size} must divide the {world} ranks of this launch "
                           f"(groups of {size} consecutive ranks); launch a multiple of {size} ranks, or another size")
    try:
        check_model(model, size)
    except ValueError as error:
        raise StartupError(str(error)) from None


def check_restarts(env=os.environ) -> None:
    """Raises :class:`StartupError` for ``torchrun --max-restarts N`` (N > 0) over several nodes.

    odb keys its store entries by restart attempt (:func:`odb.training.faults.attempt_prefix`, from
    ``TORCHELASTIC_RESTART_COUNT``), but each node's agent counts only its own workers' failures: after
    one node's worker fails, that node starts attempt 1 while the others start attempt 0 again
    (measured here with two agents: ``odb/restart1`` on one node, ``odb/restart0`` on the other), and
    no rendezvous forms. One node, or a scheduler's requeue (a new job, a new store), has no such
    disagreement."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if restarts > 0 and local < world:
        raise StartupError(f"torchrun --max-restarts {restarts} over several nodes ({world} ranks, {local} here): "
                           "each node's agent counts its own restarts, so the ranks of a restarted attempt would "
                           "disagree on which attempt it is; run multi-node jobs with --max-restarts 0 and let the "
                           "scheduler requeue them (sbatch --requeue with launch/slurm.sbatch, which resumes), or "
                           "use --max-restarts on one node only")


def check_startup(config: RunConfig) -> str:
    """Every check above, before any process group; returns the attention path (the banner's words).

    Raises:
        StartupError: naming the fix.
    """
    from odb.training.support import skeleton

    check_torch(config.optimization.backend)
    check_restarts()
    model = skeleton(config.model.path)
    check_packing(config, model)
    check_sequence_parallel(config, model)
    return probed_attention(config)


# ---- waits that say what they wait for -------------------------------------------------------------


def report_interval_s() -> float:
    """Seconds between two reports of a wait: ``$ODB_WAIT_REPORT_S``, default 30."""
    value = os.environ.get(WAIT_REPORT_ENV, "30")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{WAIT_REPORT_ENV}={value!r}: set it to a number of seconds (default 30)") from None
    if not seconds > 0:
        raise ValueError(f"{WAIT_REPORT_ENV}={value!r}: set it to a positive number of seconds (default 30)")
    return seconds


def _baton_lock(frame: FrameType | None) -> Path | None:
    """The lock file a thread polls for, if its stack (``frame`` up) is in torch's ``FileBaton.wait``."""
    from torch.utils.file_baton import FileBaton

    while frame is not None:
        if frame.f_code is FileBaton.wait.__code__:
            baton = frame.f_locals.get("self")
            return Path(baton.lock_file_path) if baton is not None else None
        frame = frame.f_back
    return None


def _building_in(folder: Path) -> bool:
    """Whether a process on this machine works in ``folder`` (torch runs ninja there, and the compilers
    it starts inherit that working directory). Processes of other users, and other machines sharing
    the folder, are not seen: the folder's modification times cover those."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")) == folder:
                return True
        except OSError:
            continue
    return False


def _last_change(folder: Path) -> float:
    """The newest modification time (``time.time()`` clock) in ``folder`` and its files; 0 if unreadable."""
    try:
        return max([folder.stat().st_mtime, *(p.stat().st_mtime for p in folder.iterdir())])
    except OSError:
        return 0.0


@dataclass
class _Lock:
    path: Path
    quiet_since: float  # time.time(): since when nothing in its folder changed (or since we saw the wait)


class _Announcer:
    """The daemon thread of :func:`announced_wait`."""

    def __init__(self, what: str, check: str, *, rank: str, timeout_s: float, interval_s: float,
                 on_exit: Callable[[], None], exit: Callable[[int], None]) -> None:
        self.what, self.check, self.rank = what, check, rank
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.on_exit, self.exit = on_exit, exit
        self.waiter = threading.get_ident()  # the thread that waits: the one entering the context
        self.started = time.monotonic()
        self.lock: _Lock | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="odb-announced-wait", daemon=True)

    def _run(self) -> None:
        tick = min(1.0, self.interval_s)
        next_report = self.interval_s
        while not self.done.wait(tick):
            self._watch_lock()
            waited = time.monotonic() - self.started
            if waited >= next_report and not self.done.is_set():
                next_report += self.interval_s
                _log(self._report(waited))

    def _watch_lock(self) -> None:
        path = _baton_lock(sys._current_frames().get(self.waiter))
        if path is None:
            self.lock = None
            return
        now = time.time()
        if self.lock is None or self.lock.path != path:
            self.lock = _Lock(path, now)
        folder = path.parent.resolve()
        self.lock.quiet_since = max(self.lock.quiet_since, _last_change(folder), now if _building_in(folder) else 0)
        quiet = now - self.lock.quiet_since
        if quiet > self.timeout_s and not self.done.is_set():
            _log(f"odb: rank {self.rank}: {path} has been there for {quiet:.0f} s with no build running (no process "
                 f"here works in {path.parent}, nothing in it changed): a C++ extension build killed while it held "
                 f"the lock left it behind. Delete it (rm {path}) and launch again; a TORCH_EXTENSIONS_DIR per "
                 f"checkout or job keeps other jobs' builds out of the way. Ending this rank with exit code "
                 f"{EXIT_STALLED}")
            try:
                self.on_exit()
            finally:
                self.exit(EXIT_STALLED)

    def _report(self, waited: float) -> str:
        lock = self.lock
        if lock is not None:
            return (f"odb: rank {self.rank}: waiting {waited:.0f} s for {self.what}: for the lock {lock.path} of "
                    f"torch's C++ extension build (another process builds {lock.path.parent.name}, or a build killed "
                    f"while it held the lock left it behind: then delete it). This rank stops once no build has run "
                    f"there for {self.timeout_s:.0f} s")
        return f"odb: rank {self.rank}: waiting {waited:.0f} s for {self.what}; {self.check}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def announced_wait(what: str, check: str, *, timeout_s: float, on_exit: Callable[[], None] = lambda: None,
                   exit: Callable[[int], None] = os._exit) -> Iterator[None]:
    """Runs the ``with`` block while a daemon thread reports, every :func:`report_interval_s`, that
    this rank is still waiting for ``what`` and what to ``check``; a wait inside torch's extension
    build lock that sees no build activity for ``timeout_s`` ends the process (see the module
    docstring).

    Args:
        what: what the rank waits for ("the model to load from ...").
        check: what to look at if the wait does not end.
        timeout_s: the run's ``--dist_timeout_s``: how long a stale build lock is waited for.
        on_exit: called just before a stale lock ends the process (local, quick).
        exit: how the process ends (``os._exit``: the waiting thread is busy).
    """
    announcer = _Announcer(what, check, rank=os.environ.get("RANK", "0"), timeout_s=timeout_s,
                           interval_s=report_interval_s(), on_exit=on_exit, exit=exit)
    announcer.thread.start()
    try:
        yield
    finally:
        announcer.done.set()
