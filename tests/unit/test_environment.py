"""Rank variables from SLURM's (odb.training.config.environment), and the loopback-hostname check."""

import socket

import pytest

from odb.training.config.environment import check_network, rank_environment, tasks_on_node


def test_tasks_per_node_in_slurms_format():
    assert [tasks_on_node("8(x2),4", n) for n in range(3)] == [8, 8, 4]
    assert tasks_on_node("1", 0) == 1
    with pytest.raises(ValueError, match="not SLURM's format"):
        tasks_on_node("8x2", 0)
    with pytest.raises(ValueError, match="SLURM_NODEID=3 is outside"):
        tasks_on_node("2(x2)", 3)


def srun_task(procid, localid, node, **extra):
    return {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(node),
            "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_NTASKS": "6",
            "MASTER_ADDR": "node1", "MASTER_PORT": "15001", **extra}


def test_an_srun_task_becomes_its_rank():
    env = srun_task(5, 1, 1)
    assert rank_environment(env) == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "6", "1", "2")


def test_a_launchers_variables_and_a_batch_script_are_left_alone():
    launched = srun_task(0, 0, 0, RANK="3", WORLD_SIZE="8")
    assert rank_environment(launched) is None and launched["RANK"] == "3"
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}  # python launch/train.py straight in a batch script
    assert rank_environment(batch) is None and "RANK" not in batch


def test_several_tasks_without_a_rendezvous_name_the_fix():
    env = srun_task(0, 0, 0)
    del env["MASTER_ADDR"]
    with pytest.raises(ValueError, match="needs MASTER_ADDR and MASTER_PORT .* launch/slurm.sbatch"):
        rank_environment(env)


def test_a_hostname_on_loopback_across_nodes_names_gloo_socket_ifname(monkeypatch):
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "10.0.0.1" if host == "node1" else "127.0.1.1")
    with pytest.raises(ValueError, match="resolves to 127.0.1.1, a loopback address.*GLOO_SOCKET_IFNAME"):
        check_network({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node1"})
    check_network({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "eth0"})  # told which
    check_network({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})  # one node: loopback is right
    check_network({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})  # "nodes" on one host
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "10.0.0.5")
    check_network({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node1"})


def test_a_one_task_step_without_a_rendezvous_gets_one_on_this_host():
    """``srun python launch/train.py`` in ``salloc -n1``: RANK alone (no MASTER_ADDR) made DeepSpeed
    look for MPI (``ModuleNotFoundError: mpi4py``); a one-process rendezvous here, as without SLURM."""
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NTASKS": "1"}
    assert rank_environment(env) == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1", "0", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1"
    with socket.socket() as s:  # the port is free: this process can host the rendezvous there
        s.bind(("127.0.0.1", int(env["MASTER_PORT"])))
    given = {**srun_task(0, 0, 0), "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert rank_environment(given) == "slurm"  # a rendezvous the user (or the sbatch script) set is kept
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("node1", "15001")


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp2"])
def test_a_rendezvous_port_another_run_holds_names_the_port_and_master_port(backend, tmp_path, monkeypatch):
    """A second ``deepspeed --num_gpus 2 launch/train.py`` on a node where another run holds port
    29500: rank 0 stops in one line naming the port and ``--master_port`` (was torch's EADDRINUSE
    traceback, while rank 1 joined the other run's store)."""
    import torch.distributed as dist

    from odb.training.launch.main import main

    other_run = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)  # another run's rendezvous
    for name in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(other_run.port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stopped:
        main(["--backend", backend, "--output_dir", str(tmp_path / "run"), "--dist_timeout_s", "60"])
    message = str(stopped.value.code)
    assert message.startswith("odb: rank 0: ") and "\n" not in message
    assert f"MASTER_PORT {other_run.port} is in use" in message and "--master_port" in message
    assert not dist.is_initialized()
