"""Where a rank learns who it is: the launcher's variables, or SLURM's when ``srun`` started it.

``deepspeed`` and ``torchrun`` set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
for each process they start. ``srun`` (``launch/slurm.sbatch``: one task per rank) sets SLURM's
own instead; :func:`rank_environment` translates them, before anything reads them::

    RANK = SLURM_PROCID   WORLD_SIZE = SLURM_STEP_NUM_TASKS   LOCAL_RANK = SLURM_LOCALID
    LOCAL_WORLD_SIZE = this node's share of SLURM_STEP_TASKS_PER_NODE ("8(x2),4": 8, 8, 4)

Only ``srun`` sets the ``SLURM_STEP_*`` variables: a process started straight from a batch script
(whose environment also has ``SLURM_PROCID`` and the job's ``SLURM_NTASKS``) stays one process.
A step of several tasks needs the rendezvous ``MASTER_ADDR`` / ``MASTER_PORT`` (the sbatch script
sets them); a step of one task (``srun python launch/train.py`` in ``salloc -n1``) without them
gets a rendezvous on this host, ``127.0.0.1`` and a free port, as ``python launch/train.py`` alone
does: with ``RANK`` set and no ``MASTER_ADDR``, DeepSpeed would look for MPI instead.

:func:`check_network` refuses, before any rank waits on another, the one multi-node setup that
otherwise fails late and unevenly: a node whose hostname resolves to a loopback address, so that
gloo advertises 127.0.x.x to the other nodes (they then fail "connectFullMesh ... Connection
refused" while this node waits), unless ``GLOO_SOCKET_IFNAME`` names the interface to use.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import MutableMapping

__all__ = ["check_network", "free_port", "rank_environment", "tasks_on_node"]


def free_port() -> int:
    """A TCP port free on this host right now (for a rendezvous of this host's processes only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Node ``node``'s task count from SLURM's ``SLURM_STEP_TASKS_PER_NODE`` (``"8(x2),4"``)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} is not SLURM's format (e.g. '8(x2),4')")
        counts += [int(match[1])] * int(match[2] or 1)
    if not 0 <= node < len(counts):
        raise ValueError(f"SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node]


def rank_environment(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Sets the rank variables from SLURM's in ``env`` when a SLURM task was started without a
    launcher (no ``RANK``); returns ``'slurm'`` then, else None (a launcher's, or one process).

    A one-task step without ``MASTER_ADDR`` and ``MASTER_PORT`` gets ``127.0.0.1`` and a free port.

    Raises:
        ValueError: a multi-task SLURM step without ``MASTER_ADDR`` / ``MASTER_PORT`` (the sbatch
            script sets them).
    """
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    has_rendezvous = "MASTER_ADDR" in env and "MASTER_PORT" in env
    if int(env["SLURM_STEP_NUM_TASKS"]) > 1 and not has_rendezvous:
        raise ValueError("a SLURM step of several tasks needs MASTER_ADDR and MASTER_PORT (the rendezvous): submit "
                         "with sbatch launch/slurm.sbatch, which sets them, or export them before srun")
    if not has_rendezvous:  # one task: the rendezvous is this process, on this host
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", env["SLURM_STEP_NUM_TASKS"]),
                          int(env.get("SLURM_NODEID", "0")))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"), LOCAL_WORLD_SIZE=str(local))
    return "slurm"


def check_network(env: MutableMapping[str, str] = os.environ) -> None:
    """Raises ``ValueError`` naming ``GLOO_SOCKET_IFNAME`` when ranks span nodes and this node's
    hostname resolves to a loopback address (no other node could reach this rank's gloo). A
    rendezvous (``MASTER_ADDR``) on loopback means every rank is on this host: nothing to check."""
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if world <= local or env.get("GLOO_SOCKET_IFNAME") or _is_loopback(env.get("MASTER_ADDR", "")):
        return  # one node; told which interface; or a rendezvous on loopback: every rank is on this host
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError as err:
        raise ValueError(f"this node's hostname {host!r} does not resolve ({err}): the other nodes cannot reach this "
                         "rank; fix the node's name resolution or set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) "
                         "to the interface that reaches the other nodes") from err
    if ipaddress.ip_address(address).is_loopback:
        raise ValueError(
            f"ranks span nodes ({world} ranks, {local} here) but this node's hostname {host!r} resolves to {address}, "
            "a loopback address: gloo would tell the other nodes to reach this rank there. Set GLOO_SOCKET_IFNAME "
            f"(and NCCL_SOCKET_IFNAME on GPUs) to the interface that reaches the other nodes; here: {_interfaces()}")


def _is_loopback(host: str) -> bool:
    try:
        return bool(host) and ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except OSError:
        return False


def _interfaces() -> str:
    try:
        import psutil
    except ImportError:
        return "see `ip -brief addr`"
    found = [f"{name} {a.address}" for name, addrs in psutil.net_if_addrs().items() for a in addrs
             if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    return ", ".join(found) or "no non-loopback IPv4 interface"
