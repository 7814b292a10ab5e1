"""Running launch/train.py for real: N CPU ranks on gloo, each rank its own process with the
environment a launcher gives it (as ``srun`` starts the ranks of launch/slurm.sbatch), or under
DeepSpeed's own runner; or one plain process. With a timeout, so that a hang fails the test instead
of stalling CI.

Every launch gets ``TORCH_EXTENSIONS_DIR`` (the checkout's own .torch_extensions unless the caller
set one: checkouts and venvs never share DeepSpeed's op builds), DeepSpeed's CPU op built once per
test session before the first DeepSpeed launch (:func:`build_cpu_ops`, not by every rank of the
first launch on the launch's clock), and a rendezvous port from :func:`free_port` held until the
launcher (or the ranks) start; a launch whose port was taken all the same is started once more on another."""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

import psutil

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "launch" / "train.py"

LAUNCHERS: list[object] = []  # every helper below that starts a process (registered by @launches)
_Launcher = TypeVar("_Launcher")


def launches(helper: _Launcher) -> _Launcher:
    """Registers ``helper`` as one that starts a process (launch/train.py or a test's worker):
    a test that calls it, directly, through a helper or through a fixture, is an ``e2e`` test
    (tests/conftest.py follows the calls), and tests/unit and tests/sim may not import it
    (tests/unit/test_layers_of_tests.py)."""
    helper.__launches__ = True
    LAUNCHERS.append(helper)
    return helper


EXTENSIONS = ROOT / ".torch_extensions"  # this checkout's own DeepSpeed op builds


def train_args(args: list[str], script: Path = TRAIN) -> list[str]:
    """``args`` for ``script``; launch/train.py's with ``--preflight off`` unless they name
    ``--preflight`` or an ``auto`` budget, and with ``--cost_model manual`` unless they or their
    ``--odb_config`` name a cost model. The preflight adds a worst-case step to every start (2 s
    of a tiny 2-rank run) and changes nothing the tests look at, as tests/e2e/test_preflight_launch.py
    checks against runs without it; the SLURM and torchrun tests start it as users do. The fitted
    cost model makes a run's plans depend on its measured times, and most tests compare one run's
    plans with another's (a resume with the uninterrupted run): the tests of the fit name it
    (tests/e2e/test_faults.py, tests/e2e/test_telemetry.py)."""
    if script != TRAIN:
        return list(args)
    budgets = ("--max_tokens", "--max_patches")
    auto = any(a in (f"{b}=auto" for b in budgets) or a == "auto" and i and args[i - 1] in budgets
               for i, a in enumerate(args))
    extra = [] if auto or _names(args, "--preflight") else ["--preflight", "off"]
    if not _names(args, "--cost_model") and "cost_model" not in _odb_file(args):
        extra += ["--cost_model", "manual"]
    return [*args, *extra]


def _names(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _odb_file(args: list[str]) -> dict:
    """The keys of the ``--odb_config`` file ``args`` name (none: {})."""
    for i, a in enumerate(args):
        path = args[i + 1] if a == "--odb_config" and i + 1 < len(args) else a.partition("=")[2] \
            if a.startswith("--odb_config=") else None
        if path and Path(path).is_file():
            return json.loads(Path(path).read_text())
    return {}


def launch_env(**values: str) -> dict[str, str]:
    """This process's environment for a launch, with ``values``; ``TORCH_EXTENSIONS_DIR`` is the
    checkout's .torch_extensions unless set already."""
    env = {**os.environ, **values}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))
    return env


_HANDED: set[int] = set()  # the ports this session handed out (never twice: a TIME_WAIT or a late launch)
_RANDOM = random.Random(os.getpid() ^ time.time_ns())


def _ports() -> range:
    """Where rendezvous ports come from: below the ephemeral range, out of which the kernel picks
    the local port of every outgoing connection (a rank's gloo or store connection could take a
    port handed out from there before the launcher binds it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, low) if low > 12000 else range(0)


def _reserve_port() -> tuple[int, socket.socket]:
    """A free port and a socket holding it (bound with SO_REUSEADDR and not listening: the
    launcher's own SO_REUSEADDR bind still succeeds, while nobody's check of a free port or
    automatic choice of one picks it). Close the socket just before the launcher binds."""
    candidates = _ports()
    for _ in range(200 if candidates else 0):
        port = _RANDOM.choice(candidates)
        if port in _HANDED:
            continue
        try:
            with socket.socket() as probe:  # no SO_REUSEADDR: fails on any socket there, TIME_WAIT too
                probe.bind(("", port))
        except OSError:
            continue
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("", port))
        except OSError:
            held.close()
            continue
        _HANDED.add(port)
        return port, held
    held = socket.socket()  # (no range below the ephemeral one here: the kernel's choice)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("", 0))
    _HANDED.add(held.getsockname()[1])
    return held.getsockname()[1], held


def free_port() -> int:
    """A port for a rendezvous: free now, outside the ephemeral range, not handed out before in
    this session. (The helpers below hold theirs until the launcher starts.)"""
    port, held = _reserve_port()
    held.close()
    return port


PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def _port_taken(returncode: int | None, output: str, port: int) -> bool:
    """Whether a launch failed because its rendezvous port was taken (torch names the port and
    EADDRINUSE): then it is started once more, on another."""
    return returncode not in (0, None) and PORT_TAKEN.search(output) is not None and str(port) in output


def _kill_tree(proc: subprocess.Popen | ForkedRank) -> None:
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    except psutil.Error:
        pass
    proc.kill()


@launches
def _run(command: Callable[[int], list[str]], env: dict[str, str], timeout: float
         ) -> tuple[subprocess.CompletedProcess, int]:
    """``command(port)`` run to its end (what subprocess.run gives, and the port), on a port held
    until the process starts; started once more on another port if the first was taken."""
    for attempt in (1, 2):
        port, held = _reserve_port()
        try:
            proc = subprocess.Popen(command(port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env, cwd=ROOT)
        finally:
            held.close()
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.communicate()
            shm_leftovers(port)
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if attempt == 1 and _port_taken(done.returncode, stdout + stderr, port):
            shm_leftovers(port)
            continue
        return done, port
    raise AssertionError("unreachable")


_BUILT: set[str] = set()  # the extension folders whose CPU op this session has built
BUILD_CPU_OP = """
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and builder.is_compatible():
    builder.load()
"""


@launches
def build_cpu_ops(env: dict[str, str] | None = None, timeout: int = 900) -> None:
    """DeepSpeed's CPU op (the shared-memory all-reduce every rank loads on DS_ACCELERATOR=cpu),
    built once per test session in the launches' extension folder, before the first DeepSpeed
    launch: not by the ranks of a launch, on its clock, each waiting in torch's build lock. One
    process at a time builds (a lock file next to the builds, for test processes and sessions run
    side by side: the others wait for it, then find the op built); a folder whose torch build lock
    is there while no test process builds (a build outside the tests, or one left by a killed
    build, which odb itself reports) is left to the launch."""
    env = env if env is not None else launch_env()
    env = {**env, "DS_ACCELERATOR": "cpu"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))
    folder = Path(env["TORCH_EXTENSIONS_DIR"])
    if str(folder) in _BUILT:
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".tests_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # first: another test process's build ends before this one looks
        try:
            if (folder / "deepspeed_shm_comm" / "lock").exists():
                return  # torch's lock of a build outside the tests, or left by a killed one
            proc = subprocess.run([sys.executable, "-c", BUILD_CPU_OP], capture_output=True, text=True,
                                  timeout=timeout, env=env, cwd=ROOT)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    output = (proc.stdout + proc.stderr)[-5000:]
    assert proc.returncode == 0, f"building DeepSpeed's CPU op in {folder} failed:\n{output}"
    _BUILT.add(str(folder))


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def sgd_step_errors(model, before: dict, after: dict, lr: float) -> tuple[dict, float, float]:
    """A run's one SGD step against the gradients in ``model`` (one process, after ``backward``):
    ``(moved, worst, still)``: every parameter name (tied weights: each of their names) with its
    step ``lr x grad``; the largest relative error of ``after - before`` against ``-step``; the
    largest change of a tensor of ``after`` without gradient."""
    import torch

    with torch.no_grad():
        steps = {id(p): lr * p.grad for p in model.parameters() if p.grad is not None and p.grad.any()}
        moved = {n: steps[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in steps}
        assert set(moved) <= set(after), sorted(set(moved) - set(after))[:4]
        worst = max(float(((after[n] - before[n]) + step).abs().max() / step.abs().max()) for n, step in moved.items())
        still = max((float((after[n] - before[n]).abs().max()) for n in after if n not in moved), default=0.0)
    return moved, worst, still


def ds_config(tmp: Path, stage: int, **overrides) -> Path:
    config = json.loads((ROOT / "configs" / f"ds_zero{stage}.json").read_text())
    config.update(overrides)
    return write_json(tmp / f"ds_zero{stage}.json", config)


def odb_config(tmp: Path, **values) -> Path:
    """configs/odb.json with ``values``, and ``cost_model`` manual unless given (:func:`train_args`
    says why; the SLURM and torchrun tests pass the file without that function)."""
    config = {**json.loads((ROOT / "configs" / "odb.json").read_text()), "cost_model": "manual"}
    config.update(values)
    return write_json(tmp / "odb.json", config)


def shm_leftovers(port: int) -> list[str]:
    """Removes and names the DeepSpeed CPU all-reduce buffers that a launch on ``port`` left in
    /dev/shm (64 MiB of RAM each, kept until the machine restarts if nobody removes them)."""
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for path in left:
        path.unlink(missing_ok=True)
    return [path.name for path in left]


def runner(nproc: int) -> list[str]:
    """The start of a command of DeepSpeed's runner of this environment, for ``nproc`` ranks on this host."""
    return [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(nproc)]


@launches
def _ranks(script: Path, args: list[str], nproc: int, env: dict[str, str], timeout: float
           ) -> tuple[subprocess.CompletedProcess, int]:
    """``script`` started ``nproc`` times on this host, one process per rank with its rank's
    environment (what torchrun or ``srun`` give a rank: RANK, LOCAL_RANK, WORLD_SIZE, ...), and no
    launcher process over them; run to the end. Each rank is forked from this test process's
    :class:`Zygote` (its imports done once), or started fresh where the environment asks for it.
    Like a launcher, it ends the others once one has failed, after ``GRACE_S`` for them to end on
    their own, and says so (``KILLED`` in stderr: a test of a failure can check that every rank
    ended by itself). The result: the exit code of the rank that failed first (else 0), and every
    rank's output, that rank's last. Started once more on another port if the first was taken."""
    zygote = Zygote.serving(env)
    for attempt in (1, 2):
        port, held = _reserve_port()
        folder = Path(tempfile.mkdtemp(prefix="odb-ranks-"))
        logs = [(folder / f"rank{rank}.out", folder / f"rank{rank}.err") for rank in range(nproc)]
        procs: list[subprocess.Popen | ForkedRank] = []
        try:
            try:
                for rank, (out, err) in enumerate(logs):
                    rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                    rank_env.setdefault("OMP_NUM_THREADS", "1")  # (as torchrun sets it)
                    if zygote is not None:
                        procs.append(zygote.fork(script, args, rank_env, out, err))
                        continue
                    with open(out, "w") as stdout, open(err, "w") as stderr:
                        procs.append(subprocess.Popen([sys.executable, str(script), *args], stdout=stdout,
                                                      stderr=stderr, text=True, env=rank_env, cwd=ROOT))
            finally:
                held.close()
            first, killed, timed_out = _wait_ranks(procs, timeout)
        finally:
            for proc in procs:  # (an error or interrupt above: no rank outlives the test)
                if proc.poll() is None:
                    _kill_tree(proc)
                    proc.wait()
            texts = [(out.read_text() if out.exists() else "", err.read_text() if err.exists() else "")
                     for out, err in logs]
            shutil.rmtree(folder, ignore_errors=True)
        order = [r for r in range(nproc) if r != first] + ([first] if first is not None else [])
        stdout, stderr = "".join(texts[r][0] for r in order), "".join(texts[r][1] for r in order)
        if killed:
            stderr += f"\n{KILLED}: rank(s) {killed} still running {GRACE_S} s after rank {first} failed\n"
        if timed_out:
            shm_leftovers(port)
            raise subprocess.TimeoutExpired([str(script), *args], timeout, output=stdout, stderr=stderr)
        code = procs[first].returncode if first is not None else 0
        done = subprocess.CompletedProcess([sys.executable, str(script), *args], code, stdout, stderr)
        if attempt == 1 and _port_taken(done.returncode, done.stdout + done.stderr, port):
            shm_leftovers(port)
            continue
        return done, port
    raise AssertionError("unreachable")


ZYGOTE = Path(__file__).resolve().parent / "zygote.py"


@launches
class Zygote:
    """A zygote of this test process (tests/zygote.py): a process that imported what a rank imports,
    started at the first launch it can serve and kept for the session; ranks are forked from it
    (:meth:`fork`). It serves the launches whose environment differs from its own only in what is
    read after the imports (``tests/zygote.py`` :func:`differs`): :meth:`serving` keeps one per
    environment the launches ask for."""

    _pool: dict[frozenset, Zygote] = {}  # by the environment each was started with, the latest used last
    POOL = 2
    """Zygotes a test process keeps: one per environment its launches ask for, the least recently
    used closed beyond this many. A zygote costs one process's imports, about what a fresh launch's
    every rank pays, so one started for a single launch costs nothing extra."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=ROOT)
        self.codes: dict[int, int] = {}
        self._pending = b""
        self._replies: list[dict] = []
        ready = self._reply(timeout=300)
        assert "ready" in ready, ready
        self.single_threaded = ready.get("threads") == 1
        atexit.register(self.close)

    def close(self) -> None:
        """Ends the zygote (its stdin closed) and waits for it."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @classmethod
    def serving(cls, env: dict[str, str]) -> Zygote | None:
        """The zygote for a launch with ``env`` (started if there is none), or None where ranks must
        start fresh (a zygote that has more than one thread cannot fork safely)."""
        import zygote

        base = {**{k: v for k, v in env.items() if k not in zygote.LATE and not k.startswith(zygote.LATE_PREFIXES)},
                **zygote.ACCELERATOR}
        if zygote.differs(env, base):  # (another DeepSpeed accelerator: the zygote imports it on the CPU one)
            return None
        key = frozenset(base.items())
        current = cls._pool.pop(key, None)
        if current is None or current.proc.poll() is not None:
            current = cls(base)
        cls._pool[key] = current
        while len(cls._pool) > cls.POOL:
            cls._pool.pop(next(iter(cls._pool))).close()
        return current if current.single_threaded else None

    def fork(self, script: Path, args: list[str], env: dict[str, str], out: Path, err: Path) -> ForkedRank:
        request = {"script": str(script), "args": list(args), "env": env, "cwd": str(ROOT), "out": str(out),
                   "err": str(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._reply(timeout=60)
        return ForkedRank(self, reply["pid"])

    def pump(self, timeout: float = 0.0) -> None:
        """Reads what the zygote said: the ranks' ends into :attr:`codes`, replies queued."""
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], timeout)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the zygote ended (exit {self.proc.wait()})")
            self._pending += chunk
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    self.codes[message["exit"]] = message["code"]
                else:
                    self._replies.append(message)
            timeout = 0.0

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._replies:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the zygote did not answer in {timeout} s")
            self.pump(timeout=0.1)
        return self._replies.pop(0)


class ForkedRank:
    """A rank forked by the :class:`Zygote`, with what :func:`_wait_ranks` uses of a ``Popen``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.zygote.pump()
            except RuntimeError:  # the zygote ended: its ranks are init's now, their codes lost
                alive = psutil.pid_exists(self.pid) and psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
                self.returncode = None if alive else 1
                return self.returncode
            self.returncode = self.zygote.codes.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, as ``Popen.wait`` (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            self.zygote.pump(timeout=0.05)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


GRACE_S = 10  # after one rank failed, the others' time to end on their own (gloo fails their next collective)
KILLED = "tests/launch.py: killed"


def _wait_ranks(procs: list[subprocess.Popen | ForkedRank], timeout: float) -> tuple[int | None, list[int], bool]:
    """Waits for every rank: the rank seen failing first (None if none did), the ranks killed
    ``GRACE_S`` after it, and whether the time ran out (every rank still running then killed)."""
    deadline, first, failed_at = time.monotonic() + timeout, None, 0.0
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first is None:
            first = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            failed_at = now
        if now > deadline or (first is not None and now > failed_at + GRACE_S):
            killed = [r for r, p in enumerate(procs) if p.poll() is None]
            for rank in killed:
                _kill_tree(procs[rank])
                procs[rank].wait()
            return first, killed, now > deadline
        time.sleep(0.1)
    if first is None:
        first = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
    return first, [], False


@launches
def deepspeed(args: list[str], *, nproc: int = 2, timeout: int = 420, script: Path = TRAIN, use_runner: bool = False
              ) -> subprocess.CompletedProcess:
    """``script`` (launch/train.py, or a test's worker) on ``nproc`` CPU ranks of the DeepSpeed
    backend; it must succeed and leave no shared memory behind.

    Each rank is its own process with the environment a launcher gives it (:func:`_ranks`, as
    ``srun`` starts the ranks of launch/slurm.sbatch), or with ``use_runner=True`` DeepSpeed's own
    runner starts them (``deepspeed --num_gpus N``, the README's command). A launcher is one more
    Python process that imports torch and watches its ranks (the runner two; a tiny 2-rank run here
    took 13 CPU-seconds started this way, about 15 under torchrun), so only the tests of what the
    launchers do pay for one: ``use_runner=True`` here, :class:`Run` and :func:`deepspeed_watched`
    (torchrun: tests/e2e/test_torchrun_restarts.py)."""
    # LOCAL_SIZE: DeepSpeed's CPU all-reduce uses shared memory only where it equals the world size
    # (its runner sets it), so every launch checks that buffer's removal
    env = launch_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **({} if use_runner else {"LOCAL_SIZE": str(nproc)}))
    build_cpu_ops(env)
    args = train_args(args, script)
    if use_runner:
        proc, port = _run(lambda port: [*runner(nproc), "--master_port", str(port), str(script), *args], env, timeout)
    else:
        proc, port = _ranks(script, args, nproc, env, timeout)
    left = shm_leftovers(port)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert not left, f"the run left DeepSpeed's shared memory behind: {left}"
    return proc


@launches
def fsdp2(args: list[str], *, nproc: int = 2, timeout: int = 420, script: Path = TRAIN
          ) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` CPU ranks of the FSDP2 backend, each rank its own process with the
    environment torchrun gives it (:func:`_ranks`); it must succeed. (torchrun itself, with its
    agent's store and restarts: tests/e2e/test_torchrun_restarts.py.)"""
    proc, _ = _ranks(script, train_args(args, script), nproc, launch_env(PYTHONUNBUFFERED="1"), timeout)
    assert proc.returncode == 0, f"{proc.stdout[-1500:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return proc


@launches
def plain(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """One process, no launcher (the bad-input tests: they must fail before any process group)."""
    env = {k: v for k, v in launch_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(TRAIN), *train_args(args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def audit(out: Path, world: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / f"emitted_ids.rank{r}.jsonl").read_text().splitlines()]
            for r in range(world)]


@launches
def deepspeed_watched(args: list[str], *, nproc: int = 2, timeout: int = 300
                      ) -> tuple[int, str, list[tuple[psutil.Process, int, str]]]:
    """The launcher, watched: its exit code, its output, and every process seen under it while it
    ran (each with its parent's pid and its command line, as first seen), polled every 0.1 s."""
    env = launch_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    build_cpu_ops(env)
    for attempt in (1, 2):
        port, held = _reserve_port()
        cmd = [*runner(nproc), "--master_port", str(port), str(TRAIN), *train_args(args)]
        seen: dict[int, tuple[psutil.Process, int, str]] = {}
        with tempfile.TemporaryFile("w+") as output:
            try:
                proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
            finally:
                held.close()
            root, deadline = psutil.Process(proc.pid), time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    _kill_tree(proc)
                    proc.wait()
                    shm_leftovers(port)
                    raise TimeoutError(f"the launcher ran past {timeout} s")
                try:
                    for child in root.children(recursive=True):
                        if child.pid not in seen:
                            seen[child.pid] = (child, child.ppid(), " ".join(child.cmdline()))
                except psutil.Error:
                    pass  # a process ended while we looked
                time.sleep(0.1)
            output.seek(0)
            shm_leftovers(port)  # a rank the launcher terminated had no chance to remove its buffer
            text = output.read()
        if attempt == 2 or not _port_taken(proc.returncode, text, port):
            return proc.returncode, text, list(seen.values())
    raise AssertionError("unreachable")


@launches
class Run:
    """A run started in the background, to be signalled while it trains: under the deepspeed
    launcher (one node), or ``apart``: each rank its own process with its own environment, no
    launcher over them (as ranks on separate nodes are, where no launcher sees a peer die), forked
    from the :class:`Zygote` where it serves the environment."""

    def __init__(self, args: list[str], *, nproc: int, apart: bool = False, port: int | None = None,
                 rank_args: dict[int, list[str]] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+")  # (a forked rank opens it by name)
        self.apart, self._args, self._nproc, self._rank_args = apart, train_args(args), nproc, rank_args or {}
        self._env = launch_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
        self._retry = port is None  # (a port the caller chose is used as it is)
        build_cpu_ops(self._env)
        self._start(port)

    def _start(self, port: int | None) -> None:
        held = None
        if port is None:
            port, held = _reserve_port()
        self.port = port
        try:
            if not self.apart:
                cmd = [*runner(self._nproc), "--master_port", str(self.port), str(TRAIN),
                       *self._args]
                self.procs = [subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                               env=self._env, cwd=ROOT)]
            else:
                self.procs = []
                zygote = Zygote.serving(self._env)
                for rank in range(self._nproc):
                    rank_env = {**self._env, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self._nproc),
                                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                                "OMP_NUM_THREADS": "1"}
                    extra = self._rank_args.get(rank, [])
                    if zygote is not None:
                        log = Path(self.log.name)
                        self.procs.append(zygote.fork(TRAIN, [*self._args, *extra], rank_env, log, log))
                        continue
                    self.procs.append(subprocess.Popen([sys.executable, str(TRAIN), *self._args, *extra],
                                                       stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                                       env=rank_env, cwd=ROOT))
        finally:
            if held is not None:
                held.close()

    def _restarted(self) -> bool:
        """Starts the run once more, on another port, if it failed because its port was taken
        (checked once: when a process is first seen to have failed)."""
        failed = [p.returncode for p in self.procs if p.poll() not in (None, 0)]
        if not self._retry or not failed:
            return False
        self._retry = False
        if not _port_taken(failed[0], self.output(), self.port):
            return False
        self.kill()
        self.log.seek(0)
        self.log.truncate()
        self._start(None)
        return True

    def rank_process(self, rank: int) -> psutil.Process:
        """The process of ``rank``."""
        if self.apart:
            return psutil.Process(self.procs[rank].pid)
        for child in psutil.Process(self.procs[0].pid).children(recursive=True):
            if f"--local_rank={rank}" in " ".join(child.cmdline()):
                return child
        raise LookupError(f"no rank {rank} under the launcher")

    def wait_for(self, condition, timeout: float = 240) -> None:
        """Polls ``condition()`` until true; fails if the run ends or the time runs out first."""
        deadline = time.monotonic() + timeout
        while not condition():
            if any(p.poll() is not None for p in self.procs):
                if self._restarted():
                    continue
                raise AssertionError(f"the run ended early:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"still waiting after {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float) -> list[int]:
        """Every process's exit code (each waited for at most ``timeout`` s from now; the rest killed)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._restarted():
                continue
            if all(p.poll() is not None for p in self.procs):
                break
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"still running {timeout} s later:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        shm_leftovers(self.port)
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            _kill_tree(proc)
            proc.wait()
        shm_leftovers(self.port)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()


def steps_trained(out: Path, rank: int = 0) -> int:
    """Steps in ``rank``'s audit file so far (written as each step is trained)."""
    path = out / f"emitted_ids.rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return len({json.loads(line)["step"] for line in lines if line.endswith("}")})  # the last may be half written
