"""Joining the process group and the rendezvous store, as the launcher describes them: every
backend's :func:`init_process_group`, and the store clients of odb's watchdog and graceful stop
(:func:`connect_store`), with the timeouts they share (:func:`intervals`, :func:`collective_timeout_s`).

Keys per attempt. The store may outlive the processes that wrote to it: ``torchrun
--max-restarts`` keeps its agent's store (static and c10d rendezvous alike, torch 2.13) and starts
every rank again, so an abort or a stop step of the failed attempt would still be there, and the
new attempt would exit 71 at once or stop at the old step. :func:`connect_store` therefore puts
odb's keys under :func:`attempt_prefix`: torchrun's ``TORCHELASTIC_RESTART_COUNT`` and SLURM's
``SLURM_RESTART_COUNT`` (a requeued job) name the attempt. The deepspeed launcher has no restarts,
and its store lives in rank 0's process, so every launch starts with an empty one; so does a
requeued SLURM job launched by ``srun`` (rank 0 hosts the store again; a process of the old job
still holding the port would make the new one fail to start, never read its keys), and the
prefix would keep the two apart even then.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

__all__ = ["attempt_prefix", "collective_timeout_s", "connect_store", "init_process_group", "process_group_kwargs",
           "uses_agent_store"]


def intervals(timeout_s: float) -> tuple[float, float]:
    """``(interval, slack)`` for a timeout: heartbeats every ``interval``; see the module docstring."""
    interval = min(5.0, max(0.5, timeout_s / 10))
    return interval, 3 * interval


def collective_timeout_s(timeout_s: float) -> float:
    """The process groups' own timeout: after every watchdog report could have come."""
    _, slack = intervals(timeout_s)
    return timeout_s + 3 * slack + 30


def attempt_prefix(env: Mapping[str, str] = os.environ) -> str:
    """The store prefix of this attempt of the run: the launcher's restart counts (see the module
    docstring), e.g. ``'odb/restart1'`` for torchrun's second attempt, ``'odb/restart0/requeue2'``
    for a job SLURM requeued twice."""
    prefix = f"odb/restart{env.get('TORCHELASTIC_RESTART_COUNT') or 0}"
    if env.get("SLURM_RESTART_COUNT"):
        prefix += f"/requeue{env['SLURM_RESTART_COUNT']}"
    return prefix


def uses_agent_store(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun's agent hosts the rendezvous store, and keeps it across restart attempts."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def process_group_kwargs(timeout_s: float, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """``init_process_group``'s ``store``, ``rank`` and ``world_size`` for this attempt where torchrun's
    agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``), else ``{}`` (torch's ``env://``).

    torch 2.13 keys its own process group's rendezvous (``default_pg/...``) without the attempt
    either: after a ``--max-restarts`` restart a rank reads a peer's address of the failed attempt
    and gloo fails ("connectFullMesh failed ... Connection refused"; measured here on CPU: 4 of 5
    restarts under the c10d rendezvous, 1 of 1 under the static one). Through this attempt's prefix
    (:func:`connect_store`, then ``process_group/``) the group forms again (4 of 4)."""
    import torch.distributed as dist

    if not uses_agent_store(env):
        return {}
    return {"store": dist.PrefixStore("process_group", connect_store(timeout_s, env)), "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"])}


def init_process_group(timeout_s: float) -> None:
    """Joins the process group the launcher describes: NCCL for the model on GPUs (gloo beside it for
    CPU tensors, odb's own collective), gloo on CPUs; under torchrun's agent store through this
    attempt's keys (:func:`process_group_kwargs`)."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **process_group_kwargs(timeout_s))


def connect_store(timeout_s: float, env: Mapping[str, str] = os.environ):
    """A client of the launcher's rendezvous store (``MASTER_ADDR``, ``MASTER_PORT`` in ``env``), of
    its own (a thread blocked on it blocks no other store user), its keys under this attempt's
    :func:`attempt_prefix`."""
    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(attempt_prefix(env), store)
