"""A real two-node SLURM cluster on this machine, started and torn down by a test, for tests of
``sbatch launch/slurm.sbatch``. Needs root, slurm-wlm and munge (see ``missing``).

Two modes:

``localhost``
    Both slurmd on this host's network (Debian's slurm is built with MULTIPLE_SLURMD): node1 and
    node2 both resolve to 127.0.0.1, and tasks on both see this host's hostname (SLURMD_NODENAME
    tells them apart). Fast; it hides address mistakes.
``netns``
    Two network namespaces joined by a veth pair, node1 at 10.210.0.1 and node2 at 10.210.0.2,
    each with its own hostname and its own /etc/hosts. slurmctld runs in node1's namespace (the
    head node), so the client commands (``sbatch``, ``scontrol``, ...) enter that namespace too. A
    job that points rank 1 at 127.0.0.1 or ``localhost`` fails here, as on a real cluster. With
    ``loopback_hostname=True`` each node's own name maps to 127.0.1.1 (Debian's default
    /etc/hosts): gloo then needs GLOO_SOCKET_IFNAME=odb0 (``INTERFACE``).

munged runs on the host with its own key and socket. Every slurm daemon runs in a mount namespace
of its own (``unshare -m``) with a hosts file bind-mounted over /etc/hosts; jobs inherit it. All
state, pid files and logs live in a temporary folder. A job sees the submitting process's
environment (PATH, an activated venv) plus SLURM_CONF and ``submit``'s ``env``, runs in
``submit``'s ``cwd``, and its batch script is a copy in slurmd's spool folder (``$0`` is not the
script's own path: use SLURM_SUBMIT_DIR). ``stop``
ends every daemon it started by its pid, then every process left in the daemons' mount namespaces
(job steps), deletes the network namespaces and removes the folder; it is safe to call twice, and
``start`` calls it when it fails half-way.

Example::

    with SlurmCluster("netns") as cluster:
        code, job_id = cluster.submit(script, ["--flag"], env={"PYTHONUNBUFFERED": "1"}, timeout=120)
        assert code == 0, cluster.output(job_id)
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INTERFACE", "MODES", "Node", "SlurmCluster", "missing"]

MODES = ("localhost", "netns")
SUBNET = "10.210.0"  # inside namespaces of our own only: nothing on the host routes to it
INTERFACE = "odb0"  # each node's end of the veth pair, one name on both (as eth0 is on a real cluster)
_COUNTER = itertools.count()
_STARTED: list[SlurmCluster] = []  # not yet stopped: stop() runs at exit for any a test left running
_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel", "unshare",
          "nsenter", "ip", "mount")


def missing() -> str | None:
    """Why no cluster can start here (not root, or a tool not installed), or None."""
    if os.geteuid() != 0:
        return "needs root (munged, slurmd, unshare and network namespaces)"
    absent = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if absent:
        return (f"not installed: {', '.join(absent)} "
                "(apt-get install -y --no-install-recommends slurm-wlm munge)")
    return None


def require_cluster() -> None:
    """For a test module's fixture: installs slurm-wlm and munge from Debian's packages when they are
    missing and this process is root (about 10 s); then skips the test when a cluster still cannot
    start here, except under CI (``CI`` set), where that is a failure."""
    import pytest

    if missing() is not None and os.geteuid() == 0 and shutil.which("apt-get"):
        quiet = {"capture_output": True, "timeout": 600, "env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}}
        subprocess.run(["apt-get", "update", "-qq"], **quiet)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"], **quiet)
    reason = missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"no SLURM cluster can start here: {reason}")
        pytest.skip(f"no SLURM cluster can start here: {reason}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mount_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class Node:
    """One node: its SLURM name (also its hostname in netns mode), the address slurm uses for it,
    and in netns mode its network namespace and the veth inside it."""

    name: str
    address: str
    netns: str | None = None
    interface: str | None = None


class SlurmCluster:
    """Two SLURM nodes (node1, node2; ``cpus`` each) and a controller on this machine.

    Args:
        mode: ``"localhost"`` or ``"netns"`` (see the module docstring).
        cpus: CPUs each node declares (slurm does not bind them: TaskPlugin=task/none).
        memory_mb: RealMemory each node declares.
        start_timeout: seconds to wait for both nodes to be idle.
        loopback_hostname: netns mode only: each node's hosts file maps the node's *own* name to
            127.0.1.1, as Debian's default /etc/hosts does (the other node's name still resolves
            to its veth address). gloo then finds no route unless GLOO_SOCKET_IFNAME is set.
    """

    def __init__(self, mode: str = "localhost", *, cpus: int = 2, memory_mb: int = 4000,
                 start_timeout: float = 30.0, loopback_hostname: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        if loopback_hostname and mode != "netns":
            raise ValueError("loopback_hostname needs mode='netns' (in localhost mode every name is loopback)")
        self.mode, self.cpus, self.memory_mb, self.start_timeout = mode, cpus, memory_mb, start_timeout
        self.loopback_hostname = loopback_hostname
        tag = f"odbtest-{os.getpid()}-{next(_COUNTER)}"
        if mode == "netns":
            self.nodes = tuple(Node(f"node{i}", f"{SUBNET}.{i}", f"{tag}-{i}", INTERFACE) for i in (1, 2))
        else:
            self.nodes = tuple(Node(f"node{i}", "127.0.0.1") for i in (1, 2))
        self.work: Path | None = None
        self.conf: Path | None = None
        self.pids: list[int] = []  # every daemon started (munged first): each runs in the foreground
        # (-D), so its pid file names this same pid
        self.namespaces: list[str] = []  # network namespaces created (and not yet deleted)
        self.socket: Path | None = None  # munged's
        self._procs: list[subprocess.Popen] = []
        self._mount_namespaces: set[str] = set()
        self.tag = tag  # in the temporary folder's name and the namespaces' names

    # -- start ---------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> SlurmCluster:
        """Starts munged, the network namespaces (netns mode), slurmctld and both slurmd, and waits
        until both nodes are idle. On any failure it stops what it started and raises."""
        reason = missing()
        if reason:
            raise RuntimeError(f"cannot start a SLURM cluster: {reason}")
        _STARTED.append(self)
        try:
            self.work = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
            self.work.chmod(0o755)  # munged refuses a socket folder others cannot read
            self._start_munge()
            if self.mode == "netns":
                self._make_namespaces()
            self.conf = self._write_conf()
            self._daemon(self.nodes[0], ["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
            for node in self.nodes:
                self._daemon(node, ["slurmd", "-D", "-f", str(self.conf), "-N", node.name], f"slurmd-{node.name}")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        key = self.work / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        self.socket = self.work / "munge.socket"
        self._spawn(["munged", "--foreground", f"--key-file={key}", f"--socket={self.socket}",
                     f"--pid-file={self.work / 'munged.pid'}", f"--log-file={self.work / 'munged.log'}",
                     f"--seed-file={self.work / 'munged.seed'}", "--num-threads=2"], "munged")
        self._wait(lambda: self.socket.exists(), 10, "munged's socket", self.work / "munged.log")

    def _make_namespaces(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            _run(["ip", "netns", "add", node.netns])
            self.namespaces.append(node.netns)
        # both ends made inside our namespaces: nothing appears on the host's network
        _run(["ip", "link", "add", a.interface, "netns", a.netns, "type", "veth", "peer", "name", b.interface,
              "netns", b.netns])
        for node in self.nodes:
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.interface])
            _run(["ip", "-n", node.netns, "link", "set", node.interface, "up"])
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])

    def _hosts_file(self, node: Node) -> Path:
        path = self.work / f"hosts-{node.name}"
        if self.mode == "netns":
            own = "127.0.1.1" if self.loopback_hostname else node.address
            lines = ["127.0.0.1 localhost"] + [f"{own if n == node else n.address} {n.name}" for n in self.nodes]
        else:  # this host's own entries (its hostname must still resolve), and the nodes
            lines = [Path("/etc/hosts").read_text().rstrip("\n"), "127.0.0.1 " + " ".join(n.name for n in self.nodes)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def _write_conf(self) -> Path:
        w, head = self.work, self.nodes[0]
        controller = f"{head.name}({head.address})" if self.mode == "netns" else "localhost(127.0.0.1)"
        node_lines = [f"NodeName={n.name} NodeHostname={n.name if self.mode == 'netns' else 'localhost'} "
                      f"NodeAddr={n.address} Port={_free_port()} CPUs={self.cpus} RealMemory={self.memory_mb} "
                      "State=UNKNOWN" for n in self.nodes]
        conf = w / "slurm.conf"
        conf.write_text(textwrap.dedent(f"""\
            ClusterName=odbtest
            SlurmctldHost={controller}
            SlurmctldPort={_free_port()}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={self.socket}
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            MpiDefault=none
            AccountingStorageType=accounting_storage/none
            JobAcctGatherType=jobacct_gather/none
            JobCompType=jobcomp/none
            MailProg=/bin/true
            ReturnToService=2
            MinJobAge=5
            EnforcePartLimits=ALL
            SlurmdParameters=config_overrides
            StateSaveLocation={w}/state
            SlurmdSpoolDir={w}/spool-%n
            SlurmctldPidFile={w}/slurmctld.pid
            SlurmdPidFile={w}/slurmd-%n.pid
            SlurmctldLogFile={w}/slurmctld.log
            SlurmdLogFile={w}/slurmd-%n.log
            SlurmctldDebug=info
            SlurmdDebug=info
            """) + "\n".join(node_lines) + "\nPartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
        (w / "state").mkdir()
        return conf

    def _daemon(self, node: Node, cmd: list[str], name: str) -> None:
        """``cmd`` in a mount namespace of its own with ``node``'s hosts file over /etc/hosts; in
        netns mode also in ``node``'s network namespace with its own hostname."""
        hosts = self._hosts_file(node)
        setup = 'mount --bind "$1" /etc/hosts && '
        wrapper = ["unshare", "-m"]
        if self.mode == "netns":
            setup += 'hostname "$2" && '
            wrapper = ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "-m", "-u"]
        # each step execs the next, so the pid we get is the daemon's
        self._spawn([*wrapper, "sh", "-c", setup + 'shift 2 && exec "$@"', "sh", str(hosts), node.name, *cmd], name)

    def _spawn(self, cmd: list[str], name: str) -> None:
        with open(self.work / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=self._env())
        self._procs.append(proc)
        self.pids.append(proc.pid)

    def _wait_idle(self) -> None:
        def idle() -> bool:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a daemon ended while starting ({proc.args[-4:]}, exit {proc.returncode}):\n"
                                       + self.logs())
            listed = self.command("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split()
            return all(node.name in listed for node in self.nodes)

        self._wait(idle, self.start_timeout, "both nodes idle")
        own = _mount_namespace(os.getpid())
        for pid in self.pids[1:]:  # the slurm daemons: by now each is past its unshare
            ns = _mount_namespace(pid)
            if ns is not None and ns != own:
                self._mount_namespaces.add(ns)

    def _wait(self, condition, timeout: float, what: str, log: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout} s:\n" + (log.read_text() if log and log.exists()
                                                                        else self.logs()))
            time.sleep(0.1)

    # -- use -----------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        if self.conf is not None:
            env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def client(self, *args: str) -> list[str]:
        """The command line that runs a slurm client command (``sbatch``, ``scontrol``, ...) where
        slurmctld is reachable: here, or in node1's network namespace."""
        if self.mode == "netns":
            return ["nsenter", f"--net=/run/netns/{self.nodes[0].netns}", *args]
        return list(args)

    def command(self, *args: str, check: bool = True, timeout: float = 30,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Runs a slurm client command against this cluster (text output captured). A plain
        ``sbatch`` here writes slurm-<id>.out into the current folder: pass ``--output``."""
        proc = subprocess.run(self.client(*args), capture_output=True, text=True, timeout=timeout,
                              env=self._env(env), stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def submit(self, script: str | os.PathLike, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               timeout: float = 120, sbatch_args: Sequence[str] = (), cwd: str | os.PathLike | None = None
               ) -> tuple[int, str]:
        """Submits ``script args`` with ``sbatch --wait`` and returns (its exit code, its job id).

        The job runs with this process's environment (sbatch's default ``--export=ALL``, so PATH and
        an activated venv come along), ``SLURM_CONF`` and ``env`` on top, in ``cwd`` (default: the
        current folder); its output goes to ``output(job_id)`` unless ``sbatch_args`` says otherwise.
        A job still running after ``timeout`` s is cancelled and TimeoutError raised (with the output).
        """
        cmd = self.client("sbatch", "--wait", "--parsable", f"--output={self.work}/job-%j.out", *sbatch_args,
                          str(script), *args)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self._env(env), cwd=cwd, stdin=subprocess.DEVNULL)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            job_id = out.strip().split(";")[0]
            if job_id:
                self.command("scancel", job_id, check=False)
            raise TimeoutError(f"job {job_id or '?'} still running after {timeout} s:\n"
                               f"{self.output(job_id) if job_id else err}") from None
        except BaseException:  # interrupted (a test's timeout): no sbatch left waiting
            proc.kill()
            proc.wait()
            raise
        job_id = out.strip().split(";")[0]
        if not job_id:
            raise RuntimeError(f"sbatch did not submit ({proc.returncode}): {err}")
        return proc.returncode, job_id

    def output(self, job_id: str) -> str:
        """The job's output file (stdout and stderr) as written to the default ``--output``."""
        path = self.work / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        if self.work is None:
            return ""
        parts = []
        for path in sorted(self.work.glob("*.log")) + sorted(self.work.glob("*.out")):
            if not path.name.startswith("job-"):
                parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ends every daemon started (by pid), every process left in their mount namespaces (job
        steps and tasks), deletes the network namespaces and the temporary folder. Idempotent."""
        # our own children, not yet reaped: their pids cannot have passed to another process
        running = [proc.pid for proc in self._procs if proc.poll() is None]
        munged = self.pids[:1]
        _kill([pid for pid in running if pid not in munged])  # slurm first: it uses munge while it stops
        _kill(self._leftovers(), grace_s=0.5)  # job steps; slurmstepd ignores SIGTERM
        _kill([pid for pid in running if pid in munged])
        for proc in self._procs:
            proc.poll()  # reap
        self.pids, self._procs, self._mount_namespaces = [], [], set()
        for name in list(self.namespaces):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)  # takes the veths with it
            if not Path(f"/run/netns/{name}").exists():
                self.namespaces.remove(name)
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
        if self in _STARTED and not self.namespaces:
            _STARTED.remove(self)

    def _leftovers(self) -> list[int]:
        """Processes still in our daemons' mount namespaces (slurmstepd and job tasks)."""
        if not self._mount_namespaces:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _mount_namespace(int(entry.name)) in self._mount_namespaces:
                found.append(int(entry.name))
        return found


@atexit.register
def _stop_all() -> None:
    for cluster in list(_STARTED):
        cluster.stop()


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def _kill(pids: Sequence[int], grace_s: float = 3.0) -> None:
    """SIGTERM to each of ``pids``, then SIGKILL to any still alive after ``grace_s``."""
    pids = [pid for pid in dict.fromkeys(pids) if pid > 1 and pid != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [pid for pid in pids if _alive(pid)]
        if not pids:
            return
