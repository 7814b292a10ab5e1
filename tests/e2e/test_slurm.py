"""``sbatch launch/slurm.sbatch`` on a real two-node SLURM cluster on this machine
(tests/slurm_cluster.py): the default run on 2 nodes x 1 CPU rank, over localhost and over two
network namespaces (each node its own address and hostname, so address mistakes fail), and a
rank killed on one node ending the job on both."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from launch import ROOT, audit, ds_config, odb_config, steps_trained
from slurm_cluster import SlurmCluster, require_cluster

SCRIPT = ROOT / "launch" / "slurm.sbatch"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def slurm_installed():
    require_cluster()
SAMPLES = 240


def job_args(tmp_path, backend="deepspeed"):
    chosen = ["--deepspeed_config", str(ds_config(tmp_path, 2))] if backend == "deepspeed" else ["--backend", "fsdp2"]
    return [*chosen, "--audit_ids", "--max_samples", str(SAMPLES),
            "--odb_config", str(odb_config(tmp_path, max_tokens=1024, window=32, lookahead=16)),
            "--dist_timeout_s", "20"]


def job_env(out):
    return {"ODB_PYTHON": sys.executable, "ODB_OUTPUT_DIR": str(out), "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", "")}


def env_without_empty(env):
    return {k: v for k, v in env.items() if v}


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2"])
def test_sbatch_trains_on_two_nodes_aligned_every_sample_once_one_summary(tmp_path, backend):
    """Over two network hosts (the localhost cluster runs it in the tests below, to a stop or a kill),
    under either backend: the script is the same, the backend one of train.py's flags."""
    out = tmp_path / "out"
    with SlurmCluster("netns") as cluster:
        code, job = cluster.submit(SCRIPT, job_args(tmp_path, backend), env=env_without_empty(job_env(out)),
                                   timeout=400, sbatch_args=["--nodes=2", "--ntasks-per-node=1"], cwd=ROOT)
        output = cluster.output(job)
    assert code == 0, output[-4000:]
    assert "2 node(s), 2 task(s)" in output, output[-2000:]
    rows = audit(out, 2)
    steps = [[row["step"] for row in rank_rows] for rank_rows in rows]
    assert steps[0] == steps[1] and steps[0], "both nodes trained the same steps and micro-batches"
    assert Counter(i for rank_rows in rows for row in rank_rows for i in row["ids"]) == Counter(range(SAMPLES))
    summary = json.loads((out / "summary.json").read_text())  # one summary, one metrics stream (rank 0)
    assert summary["world_size"] == 2 and summary["samples_emitted"] == SAMPLES
    assert summary["config"]["optimization"]["backend"] == backend
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r] == sorted(set(steps[0]))


def rank_process(rank: int) -> psutil.Process | None:
    """The SLURM task of odb's ``rank`` (its environment says SLURM_PROCID)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any("launch/train.py" in part for part in proc.info["cmdline"] or []) and \
                    proc.environ().get("SLURM_PROCID") == str(rank) and proc.environ().get("RANK") is None:
                return proc
        except psutil.Error:
            continue
    return None


def test_a_rank_killed_on_one_node_ends_the_job_on_both(tmp_path):
    out = tmp_path / "out"
    with SlurmCluster("localhost") as cluster:
        cmd = cluster.client("sbatch", "--wait", "--parsable", f"--output={cluster.work}/job-%j.out",
                             "--nodes=2", "--ntasks-per-node=1", str(SCRIPT), *job_args(tmp_path),
                             "--max_samples", "2000")
        env = {**cluster._env(env_without_empty(job_env(out)))}
        sbatch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        try:
            deadline = time.monotonic() + 300
            while steps_trained(out) < 3:
                assert sbatch.poll() is None and time.monotonic() < deadline, "the job ended before it trained"
                time.sleep(0.5)
            victim = rank_process(1)
            assert victim is not None, "rank 1's task"
            victim.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            sbatch.wait(timeout=300)  # (against a hang only: how long the end took is printed, not judged)
            elapsed = time.monotonic() - killed
        finally:
            if sbatch.poll() is None:
                sbatch.kill()
        job = sbatch.stdout.read().strip().split(";")[0]
        output = cluster.output(job)
    print(f"SLURM: rank 1 killed, the job ended on both nodes {elapsed:.1f} s later (exit {sbatch.returncode})")
    assert sbatch.returncode != 0, output[-3000:]
    assert rank_process(0) is None, "rank 0's task on node1 ended too"


def test_a_node_whose_hostname_is_on_loopback_stops_the_job_at_once_naming_gloo_socket_ifname(tmp_path):
    """Debian's /etc/hosts maps a node's own name to 127.0.1.1: gloo would advertise that address
    to the other node. odb refuses before any rank waits; SLURM ends the job on both nodes."""
    out = tmp_path / "out"
    with SlurmCluster("netns", loopback_hostname=True) as cluster:
        began = time.monotonic()
        code, job = cluster.submit(SCRIPT, job_args(tmp_path), env=env_without_empty(job_env(out)), timeout=120,
                                   sbatch_args=["--nodes=2", "--ntasks-per-node=1"], cwd=ROOT)
        elapsed = time.monotonic() - began
        output = cluster.output(job)
    assert code != 0
    assert "hostname 'node2' resolves to 127.0.1.1, a loopback address" in output, output[-3000:]
    assert "Set GLOO_SOCKET_IFNAME" in output and "odb0 10.210.0.2" in output
    print(f"loopback hostname: the job ended {elapsed:.0f} s after its submission")  # (the refusal: its message)


def test_a_deepspeed_hostfile_without_ssh_trains_across_two_network_hosts(tmp_path):
    """The path for clusters without SLURM, on the same two network hosts (SLURM idle): the same
    ``deepspeed --hostfile H --no_ssh --node_rank R`` command on each node."""
    out, hostfile, port = tmp_path / "out", tmp_path / "hostfile", 29611
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    launcher = Path(sys.executable).with_name("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "odb0",
           "PYTHONUNBUFFERED": "1"}
    with SlurmCluster("netns") as cluster:
        nodes = []
        for rank, node in enumerate(cluster.nodes):
            command = (f"hostname {node.name}; exec {launcher} --hostfile {hostfile} --no_ssh --node_rank {rank} "
                       f"--master_addr {cluster.nodes[0].address} --master_port {port} {ROOT / 'launch' / 'train.py'} "
                       + " ".join(job_args(tmp_path)) + f" --output_dir {out} --no_final_checkpoint --max_samples 100")
            nodes.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "-u", "sh", "-c",
                                           command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        try:
            outputs = [node.communicate(timeout=300)[0] for node in nodes]
        finally:
            for node in nodes:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    rows = audit(out, 2)
    assert Counter(i for rank_rows in rows for row in rank_rows for i in row["ids"]) == Counter(range(100))
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


def test_sigterm_from_slurm_saves_exits_75_and_the_next_job_resumes_exactly(tmp_path):
    """What ``--signal=TERM@120`` (or ``scancel --signal=TERM``) does to a job: every rank stops after
    the same step and saves, the job exits 75; the next job with the same ODB_OUTPUT_DIR resumes by
    itself, and over both jobs every sample trains exactly once."""
    out = tmp_path / "out"
    with SlurmCluster("localhost") as cluster:
        cmd = cluster.client("sbatch", "--wait", f"--output={cluster.work}/job-%j.out", "--nodes=2",
                             "--ntasks-per-node=1", str(SCRIPT), *job_args(tmp_path))
        sbatch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=cluster._env(env_without_empty(job_env(out))), cwd=ROOT)
        try:
            deadline = time.monotonic() + 300
            while steps_trained(out) < 3:
                assert sbatch.poll() is None and time.monotonic() < deadline, "the job ended before it trained"
                time.sleep(0.5)
            [job] = cluster.command("squeue", "-h", "-o", "%i").stdout.split()
            cluster.command("scancel", "--signal=TERM", job)  # the job steps' tasks get SIGTERM, as at TERM@120
            signalled = time.monotonic()
            sbatch.wait(timeout=120)
            elapsed = time.monotonic() - signalled
        finally:
            if sbatch.poll() is None:
                sbatch.kill()
        first = cluster.output(job)
        assert sbatch.returncode == 75, first[-3000:]
        assert "stopped on request (exit 75)" in first
        code, second_job = cluster.submit(SCRIPT, job_args(tmp_path), env=env_without_empty(job_env(out)),
                                          timeout=400, sbatch_args=["--nodes=2", "--ntasks-per-node=1"], cwd=ROOT)
        second = cluster.output(second_job)
    print(f"SLURM SIGTERM: exit 75 {elapsed:.1f} s after the signal; the next job resumed")
    assert code == 0, second[-3000:]
    assert "resumed from" in second
    rows = audit(out, 2)
    assert Counter(i for rank_rows in rows for row in rank_rows for i in row["ids"]) == Counter(range(SAMPLES))


def test_a_job_naming_its_output_dir_among_the_arguments_resumes_there(tmp_path):
    """``--output_dir X`` among the script's arguments (the usual way to name a run), no
    ODB_OUTPUT_DIR: the script looked for checkpoints in runs/slurm-<job id> while training wrote to
    X, so the next job retrained from step 0 in X, appending a second run to its metrics.jsonl. The
    first job stops after 3 steps with its final checkpoint; the same command again continues in X.
    Both spellings of the flag."""
    out = tmp_path / "named"
    env = env_without_empty({k: v for k, v in job_env(out).items() if k != "ODB_OUTPUT_DIR"})
    sbatch_args = ["--nodes=2", "--ntasks-per-node=1"]
    with SlurmCluster("localhost") as cluster:
        code, job = cluster.submit(SCRIPT, [*job_args(tmp_path), f"--output_dir={out}", "--max_steps", "3"], env=env,
                                   timeout=400, sbatch_args=sbatch_args, cwd=ROOT)
        first = cluster.output(job)
        assert code == 0, first[-3000:]
        code, job = cluster.submit(SCRIPT, [*job_args(tmp_path), "--output_dir", str(out)], env=env, timeout=400,
                                   sbatch_args=sbatch_args, cwd=ROOT)
        second = cluster.output(job)
    assert code == 0, second[-3000:]
    assert f"output {out}" in first and f"output {out}" in second
    assert f"resumed from {out / 'checkpoints' / 'step3'}" in second, second[-3000:]
    rows = audit(out, 2)
    assert Counter(i for rank_rows in rows for row in rank_rows for i in row["ids"]) == Counter(range(SAMPLES))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(len(steps))), "one run in metrics.jsonl: every step once, in order"


def test_a_one_task_srun_step_trains(tmp_path):
    """``srun python launch/train.py`` in a one-task allocation (``salloc -n1``), no MASTER_ADDR: the
    rank variables alone sent DeepSpeed into MPI discovery (``ModuleNotFoundError: mpi4py``)."""
    out, script = tmp_path / "one", tmp_path / "one_task.sh"
    script.write_text('#!/bin/bash\nsrun "$ODB_PYTHON" "$SLURM_SUBMIT_DIR/launch/train.py" "$@"\n')
    env = env_without_empty({k: v for k, v in job_env(out).items() if k != "ODB_OUTPUT_DIR"})
    with SlurmCluster("localhost") as cluster:
        code, job = cluster.submit(script, ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "24",
                                            "--odb_config", str(odb_config(tmp_path, max_tokens=1024, window=16)),
                                            "--output_dir", str(out), "--no_final_checkpoint"],
                                   env=env, timeout=300, sbatch_args=["--nodes=1", "--ntasks=1"], cwd=ROOT)
        output = cluster.output(job)
    assert code == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["samples_emitted"] == 24


def test_a_requeued_job_continues_from_its_latest_checkpoint_not_the_tag_it_was_started_with(tmp_path):
    """A job started with ``--resume step3`` and ``--requeue``, requeued mid-run (``scontrol
    requeue``: SLURM_RESTART_COUNT 1): the script kept ``--resume step3`` on every requeue, so each
    attempt went back to step 3 and trained the steps after it again. Now a requeue continues from
    the run's latest checkpoint (``--resume auto``): over the three attempts every sample trains
    exactly once."""
    out = tmp_path / "requeued"
    env = env_without_empty({k: v for k, v in job_env(out).items() if k != "ODB_OUTPUT_DIR"})
    one = ["--nodes=1", "--ntasks-per-node=1"]
    with SlurmCluster("localhost") as cluster:
        code, job = cluster.submit(SCRIPT, [*job_args(tmp_path), "--output_dir", str(out), "--max_steps", "3"],
                                   env=env, timeout=400, sbatch_args=one, cwd=ROOT)
        assert code == 0, cluster.output(job)[-3000:]
        cmd = cluster.client("sbatch", "--wait", "--parsable", "--requeue", f"--output={cluster.work}/job-%j.out",
                             *one, str(SCRIPT), *job_args(tmp_path), "--output_dir", str(out), "--resume", "step3",
                             "--save_steps", "1")
        sbatch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=cluster._env(env), cwd=ROOT)
        try:
            deadline = time.monotonic() + 300
            while steps_trained(out) < 7:
                assert sbatch.poll() is None and time.monotonic() < deadline, "the job ended before it trained"
                time.sleep(0.5)
            [job] = cluster.command("squeue", "-h", "-o", "%i").stdout.split()
            cluster.command("scontrol", "requeue", job)
            requeued = time.monotonic()
            # SLURM holds a requeued job back (its begin time moves ahead); let it start as soon as it can
            pending = False
            while sbatch.poll() is None and time.monotonic() - requeued < 120:
                state = cluster.command("squeue", "-h", "-j", job, "-o", "%T %r", check=False).stdout.split()
                pending = pending or state[:1] == ["PENDING"]
                if state[:1] == ["PENDING"] and "BeginTime" in state:
                    cluster.command("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
                if pending and state[:1] == ["RUNNING"]:
                    break
                time.sleep(1)
            sbatch.wait(timeout=400)
        finally:
            if sbatch.poll() is None:
                sbatch.kill()
        output = cluster.output(job)
    assert sbatch.returncode == 0, output[-4000:]
    resumed = re.findall(r"resumed from \S+/checkpoints/(step\d+)", output)
    print(f"requeued job: resumed from {resumed}")
    assert resumed[0] == "step3" and len(resumed) == 2 and int(resumed[1][4:]) > 3, output[-4000:]
    rows = audit(out, 1)
    assert Counter(i for rank_rows in rows for row in rank_rows for i in row["ids"]) == Counter(range(SAMPLES))
