"""The harness of tests/slurm_cluster.py: a real two-node SLURM cluster, here (localhost) and across
two network namespaces (netns), runs one task per node, hands back a job's exit code, leaves
nothing behind, and carries gloo between the nodes (and shows when gloo needs GLOO_SOCKET_IFNAME)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import INTERFACE, SlurmCluster, require_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module", autouse=True)
def slurm_installed():
    require_cluster()

# every script finds the test's python through $PYTHON (the job sees this process's environment)
TWO_NODES = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1
"""

REPORT = TWO_NODES + """srun hostname
srun "$PYTHON" -c 'import os, socket
name = socket.gethostname()
print("task", os.environ["SLURM_PROCID"], os.environ["SLURMD_NODENAME"], name, socket.gethostbyname(name),
      ",".join(sorted(n for _, n in socket.if_nameindex())), flush=True)'
"""

GLOO = TWO_NODES + """export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
srun --kill-on-bad-exit=1 "$PYTHON" "$WORKER"
"""

GLOO_WORKER = """import datetime, os, socket
import torch
import torch.distributed as dist

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                        rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} on {socket.gethostname()}: sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""


def script(tmp_path: Path, text: str, name: str = "job.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def tasks(output: str) -> dict[int, list[str]]:
    """``task RANK NODENAME HOSTNAME ADDRESS INTERFACES`` lines, by rank."""
    return {int(line.split()[1]): line.split()[2:] for line in output.splitlines() if line.startswith("task ")}


@pytest.fixture(scope="module", params=["localhost", "netns"])
def cluster(request):
    with SlurmCluster(request.param) as running:
        yield running


def run(cluster: SlurmCluster, path: Path, **env: str) -> tuple[int, str]:
    code, job_id = cluster.submit(path, env={"PYTHON": sys.executable, **env}, timeout=120, cwd=path.parent)
    return code, cluster.output(job_id)


def gloo(cluster: SlurmCluster, tmp_path: Path, **env: str) -> tuple[int, str]:
    worker = script(tmp_path, GLOO_WORKER, "worker.py")
    return run(cluster, script(tmp_path, GLOO), WORKER=str(worker), OMP_NUM_THREADS="1", **env)


def test_two_node_job_runs_one_task_on_each_node(cluster, tmp_path):
    code, output = run(cluster, script(tmp_path, REPORT))
    assert code == 0, output
    seen = tasks(output)
    assert sorted(seen) == [0, 1], output
    assert {seen[r][0] for r in seen} == {"node1", "node2"}, output  # SLURMD_NODENAME
    if cluster.mode == "netns":  # two hosts: own hostname, own address, only lo and the veth
        assert [seen[r][1:] for r in (0, 1)] == [["node1", "10.210.0.1", f"lo,{INTERFACE}"],
                                                 ["node2", "10.210.0.2", f"lo,{INTERFACE}"]], output


def test_failing_job_exit_code_comes_back_from_sbatch_wait(cluster, tmp_path):
    code, output = run(cluster, script(tmp_path, TWO_NODES + "srun hostname\nexit 3\n"))
    assert code == 3, output


def test_impossible_job_is_refused_not_left_pending(cluster, tmp_path):
    with pytest.raises(RuntimeError, match="sbatch did not submit"):
        cluster.submit(script(tmp_path, "#!/bin/bash\n#SBATCH --nodes=3\nhostname\n"), timeout=30)


@pytest.mark.parametrize("mode", ["localhost", "netns"])
def test_stop_ends_daemons_jobs_and_namespaces(mode, tmp_path):
    cluster = SlurmCluster(mode)
    try:
        cluster.start()
        daemons, namespaces, work = list(cluster.pids), list(cluster.namespaces), cluster.work
        assert len(daemons) == 4 and all(alive(pid) for pid in daemons)
        pid_files = {int(path.read_text().split()[0]) for path in work.glob("*.pid")}
        assert pid_files == set(daemons), "a daemon's pid file names another process than the one started"
        assert len(namespaces) == (2 if mode == "netns" else 0)
        # a job still running when the cluster stops: its tasks must end too
        job = script(tmp_path, TWO_NODES + 'srun bash -c \'echo $$ > "$DIR/task.$SLURM_PROCID"; exec sleep 300\'\n')
        cluster.command("sbatch", f"--output={tmp_path}/job.out", str(job), env={"DIR": str(tmp_path)})
        task_files = [tmp_path / "task.0", tmp_path / "task.1"]
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_text().strip() for p in task_files):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        task_pids = [int(p.read_text()) for p in task_files]
    finally:
        cluster.stop()
    for pid in daemons + task_pids:
        assert not alive(pid), f"pid {pid} outlived stop()"
    for name in namespaces:
        assert not Path(f"/run/netns/{name}").exists()
    assert not work.exists()
    cluster.stop()  # a second stop does nothing


@pytest.mark.parametrize("mode", ["localhost", "netns"])
def test_start_that_fails_leaves_nothing_behind(mode):
    class FailsLast(SlurmCluster):
        def _wait_idle(self) -> None:  # everything is up by now
            super()._wait_idle()
            raise RuntimeError("the last step of start() failed")

    cluster = FailsLast(mode)
    with pytest.raises(RuntimeError, match="last step"):
        cluster.start()
    assert cluster.pids == [] and cluster.namespaces == [] and cluster.work is None
    assert not list(Path("/run/netns").glob(f"{cluster.tag}-*")) if Path("/run/netns").is_dir() else True
    ours = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and cluster.tag in cmdline(p)]
    assert not ours, f"processes of the cluster outlived a failed start: {ours}"


def cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# gloo across the two network hosts with hostnames that resolve to their own addresses is what
# tests/e2e/test_slurm.py's training runs do; here, the case where it fails without help
def test_gloo_needs_gloo_socket_ifname_when_own_hostname_is_loopback(tmp_path):
    """The cluster of MULTINODE.md's warning: each node's own name maps to 127.0.1.1 (Debian's
    default /etc/hosts). gloo advertises that address to the peer and fails, and srun's
    --kill-on-bad-exit ends the other rank, unless GLOO_SOCKET_IFNAME names the interface."""
    with SlurmCluster("netns", loopback_hostname=True) as cluster:
        code, output = gloo(cluster, tmp_path)
        assert code != 0, output
        assert "connectFullMesh failed" in output and "127.0.1.1" in output, output
        code, output = gloo(cluster, tmp_path, GLOO_SOCKET_IFNAME=INTERFACE)
        assert code == 0, output
        assert {"rank 0 on node1: sum 3", "rank 1 on node2: sum 3"} <= set(output.splitlines()), output

