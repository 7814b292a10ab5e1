"""Running launch/train.py for real: under the deepspeed launcher (N CPU ranks on gloo) or as
one plain process, with a timeout so that a hang fails the test instead of stalling CI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TypeVar

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def ds_config(tmp: Path, stage: int, **overrides) -> Path:
    config = json.loads((ROOT / "configs" / f"ds_zero{stage}.json").read_text())
    config.update(overrides)
    return write_json(tmp / f"ds_zero{stage}.json", config)


def odb_config(tmp: Path, **values) -> Path:
    config = json.loads((ROOT / "configs" / "odb.json").read_text())
    config.update(values)
    return write_json(tmp / "odb.json", config)


def shm_leftovers(port: int) -> list[str]:
    """Removes and names the DeepSpeed CPU all-reduce buffers that a launch on ``port`` left in
    /dev/shm (64 MiB of RAM each, kept until the machine restarts if nobody removes them)."""
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    for path in left:
        path.unlink(missing_ok=True)
    return [path.name for path in left]


@launches
def deepspeed(args: list[str], *, nproc: int = 2, timeout: int = 420, script: Path = TRAIN
              ) -> subprocess.CompletedProcess:
    """``script`` (launch/train.py, or a test's worker) on ``nproc`` CPU ranks under the deepspeed
    launcher; it must succeed and leave no shared memory behind."""
    launcher, port = Path(sys.executable).with_name("deepspeed"), free_port()
    cmd = [str(launcher), "--num_gpus", str(nproc), "--master_port", str(port), str(script), *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    finally:
        left = shm_leftovers(port)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert not left, f"the run left DeepSpeed's shared memory behind: {left}"
    return proc


@launches
def torchrun(args: list[str], *, nproc: int = 2, timeout: int = 420, script: Path = TRAIN
             ) -> subprocess.CompletedProcess:
    """``script`` on ``nproc`` CPU ranks under torchrun (the FSDP2 backend's launcher); it must succeed."""
    launcher = Path(sys.executable).with_name("torchrun")
    cmd = [str(launcher), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-1500:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return proc


@launches
def plain(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """One process, no launcher (the bad-input tests: they must fail before any process group)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(TRAIN), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def audit(out: Path, world: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / f"emitted_ids.rank{r}.jsonl").read_text().splitlines()]
            for r in range(world)]


@launches
def deepspeed_watched(args: list[str], *, nproc: int = 2, timeout: int = 300
                      ) -> tuple[int, str, list[tuple[psutil.Process, int, str]]]:
    """The launcher, watched: its exit code, its output, and every process seen under it while it
    ran (each with its parent's pid and its command line, as first seen), polled every 0.1 s."""
    launcher, port = Path(sys.executable).with_name("deepspeed"), free_port()
    cmd = [str(launcher), "--num_gpus", str(nproc), "--master_port", str(port), str(TRAIN), *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    seen: dict[int, tuple[psutil.Process, int, str]] = {}
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        root, deadline = psutil.Process(proc.pid), time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
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
        return proc.returncode, output.read(), list(seen.values())


@launches
class Run:
    """A run started in the background, to be signalled while it trains: under the deepspeed
    launcher (one node), or ``apart``: each rank its own process with its own environment, no
    launcher over them (as ranks on separate nodes are, where no launcher sees a peer die)."""

    def __init__(self, args: list[str], *, nproc: int, apart: bool = False, port: int | None = None,
                 rank_args: dict[int, list[str]] | None = None) -> None:
        self.port = port or free_port()
        self.log = tempfile.TemporaryFile("w+")
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
        if not apart:
            cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(nproc), "--master_port",
                   str(self.port), str(TRAIN), *args]
            self.procs = [subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
                                           cwd=ROOT)]
        else:
            self.procs = []
            for rank in range(nproc):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(nproc),
                            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                            "OMP_NUM_THREADS": "1"}
                extra = (rank_args or {}).get(rank, [])
                self.procs.append(subprocess.Popen([sys.executable, str(TRAIN), *args, *extra], stdout=self.log,
                                                   stderr=subprocess.STDOUT, text=True, env=rank_env, cwd=ROOT))
        self.apart = apart

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
                raise AssertionError(f"the run ended early:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"still waiting after {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait(self, timeout: float) -> list[int]:
        """Every process's exit code (each waited for at most ``timeout`` s from now; the rest killed)."""
        deadline, codes = time.monotonic() + timeout, []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"still running {timeout} s later:\n{self.output()[-4000:]}") from None
        shm_leftovers(self.port)
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            except psutil.Error:
                pass
            proc.kill()
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
