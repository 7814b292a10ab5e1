"""Waits that say what they wait for: :func:`announced_wait` around each wait before the first
step that can take long (the rendezvous, with DeepSpeed its CPU ops' build first; the model load
and backend set-up; a big data file's index). While the wrapped code runs, a daemon thread prints,
every :data:`WAIT_REPORT_ENV` seconds (default 30)::

    odb: rank 1: waiting 60 s for the other ranks to join the process group (...); check ...

and watches for the one wait that never ends by itself: torch's C++ extension build lock. torch's
``cpp_extension.load`` (DeepSpeed builds its ops with it) lets one process build while every other
waits, polling without limit, until the builder deletes ``<build folder>/lock``. A build killed
while it held the lock leaves the file behind, and every later launch on that cache waits for ever
with no output. When the waiting thread is inside that wait (its stack shows torch's
``FileBaton.wait``), the report names the lock; once no build has run there for the run's
``--dist_timeout_s`` (no process on this machine works in the build folder, and nothing in it
changed), the rank ends (exit code :data:`odb.training.run.watchdog.EXIT_STALLED`) naming the file
to delete. A wait inside a ``filelock`` lock (Hugging Face ``datasets`` converting a Parquet file
into its cache: one process converts, every other waits on ``<cache>/..._builder.lock`` with no
output) is reported with the lock's file and the process that holds it (from ``/proc/locks``); such
a lock dies with its holder, so it is only reported. The other waits (the rendezvous, bounded by
the process group's own timeout; a model load) are only reported."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from odb.training.run.watchdog import EXIT_STALLED

__all__ = ["WAIT_REPORT_ENV", "announced_wait"]

WAIT_REPORT_ENV = "ODB_WAIT_REPORT_S"
"""Seconds between two reports of a wait (default 30); tests set less."""


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


def _file_lock(frame: FrameType | None) -> Path | None:
    """The lock file a thread waits for, if its stack (``frame`` up) is acquiring a ``filelock`` lock
    (``datasets``' cache locks are ones)."""
    try:
        from filelock import BaseFileLock
    except ImportError:
        return None
    while frame is not None:
        lock = frame.f_locals.get("self")
        if isinstance(lock, BaseFileLock) and "acquire" in frame.f_code.co_name:
            return Path(lock.lock_file)
        frame = frame.f_back
    return None


def lock_holder(path: Path, locks: Path = Path("/proc/locks")) -> str | None:
    """Which process on this machine holds the ``flock``/``fcntl`` lock on file ``path``: ``'pid N
    (its command)'`` from ``locks`` (the kernel's table), or None (none, or not seen here)."""
    try:
        inode, table = path.stat().st_ino, locks.read_text()
    except OSError:
        return None
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF"
        fields = line.split()
        if len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode) and fields[4].isdigit():
            pid = int(fields[4])
            try:
                command = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"))
                command = " ".join(command.split())
            except OSError:
                command = ""
            return f"pid {pid}" + (f" ({command[:120]})" if command else "")
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
        self.file_lock: Path | None = None  # a filelock lock the waiting thread waits for
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="odb-announced-wait", daemon=True)

    def _run(self) -> None:
        tick = min(1.0, self.interval_s)
        next_report = self.interval_s
        while not self.done.wait(tick):
            self._watch_lock()
            self.file_lock = _file_lock(sys._current_frames().get(self.waiter))
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
        if self.file_lock is not None:
            holder = lock_holder(self.file_lock) or "another process, maybe on another machine"
            return (f"odb: rank {self.rank}: waiting {waited:.0f} s for {self.what}: for the lock {self.file_lock}, "
                    f"held by {holder} (Hugging Face datasets converts a file into its cache once, under this lock, "
                    "while every other process waits; the lock is released when its holder finishes or dies)")
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
