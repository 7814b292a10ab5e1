"""The ranks' common start, paid once: a process that imports what every rank of a test's launch
imports (torch, transformers, DeepSpeed, PEFT, odb: about 4 CPU-seconds, most of a tiny run's),
then forks each rank from there (the way DataLoader workers are forked), instead of each rank
starting a fresh interpreter and importing them again. Used by ``tests/launch.py`` (:class:`Zygote`)
for the ranks it starts without a launcher; the tests of the launchers (DeepSpeed's runner,
torchrun, SLURM) start fresh interpreters as users do.

A forked rank runs its script as ``python script args`` would (``__main__``, ``sys.argv``,
``sys.path[0]``), with its own environment, working folder and output files; what differs is that
the modules above were imported before its environment was set. So the zygote serves only
launches whose environment differs from its own in the variables read after import (a rank's
place, ``OMP_NUM_THREADS``, odb's and W&B's settings): :func:`differs` names the others, and
``tests/launch.py`` starts such a launch fresh.

Protocol (JSON lines): the zygote says ``{"ready": pid}`` once imported; each request
``{"script", "args", "env", "cwd", "out", "err"}`` is answered ``{"pid": pid}``, and each rank's
end is reported as ``{"exit": pid, "code": code}`` (``-N``: killed by signal N, as
``subprocess`` reports it).
"""

from __future__ import annotations

import gc
import json
import os
import select
import sys

LATE = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
        "LOCAL_SIZE")
"""Variables read only after the imports (by odb, torch.distributed, DeepSpeed's CPU all-reduce):
a launch may set them as it likes."""
LATE_PREFIXES = ("ODB_", "WANDB_", "PYTEST_")
ACCELERATOR = {"DS_ACCELERATOR": "cpu"}
"""The zygote imports DeepSpeed on the CPU accelerator (it picks one at import): a launch that
names another is not served (one that names none runs no DeepSpeed: FSDP2's)."""


def differs(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables of ``env`` the zygote started with ``base`` cannot give a rank (read at import)."""
    keys = set(env) | set(base)
    return sorted(k for k in keys if env.get(k) != base.get(k) and k not in LATE and not k.startswith(LATE_PREFIXES)
                  and not (k in ACCELERATOR and env.get(k) in (None, ACCELERATOR[k])))


def _odb_first() -> None:
    """odb before the libraries, as a rank imports it: its import keeps DeepSpeed's autotuner from
    importing mlflow (odb/imports.py)."""
    sys.path.insert(0, os.getcwd())
    import odb  # noqa: F401

    sys.path.remove(os.getcwd())


def _imports() -> None:
    import deepspeed  # noqa: F401
    import deepspeed.module_inject.auto_ep_layer  # noqa: F401
    import deepspeed.moe.layer  # noqa: F401
    import deepspeed.ops.op_builder.all_ops  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401 (its setuptools and distutils: DeepSpeed's CPU op)
    import transformers  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401 (its torch.compile: dynamo, inductor)
    from transformers import AutoModelForCausalLM  # noqa: F401

    sys.path.insert(0, os.getcwd())
    import odb.training.backends.deepspeed  # noqa: F401
    import odb.training.backends.fsdp2  # noqa: F401
    import odb.training.config.environment  # noqa: F401
    import odb.training.launch.flags  # noqa: F401
    import odb.training.model.capability  # noqa: F401
    import odb.training.run.loop  # noqa: F401
    import odb.training.run.startup  # noqa: F401
    sys.path.remove(os.getcwd())


def _rank(request: dict, channel: int) -> None:
    """In the forked child: becomes ``python script args`` and never returns."""
    code = 1
    try:
        os.close(channel)
        write = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        for fd, path, flags in ((1, request["out"], write), (2, request["err"], write), (0, os.devnull, os.O_RDONLY)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import torch

        if "OMP_NUM_THREADS" in os.environ:  # (OpenMP read the variable when torch loaded it, in the zygote)
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught error
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main() -> None:
    channel = os.dup(1)  # the protocol's; what the libraries print goes to stderr
    os.dup2(2, 1)
    os.environ.update(ACCELERATOR)
    # one thread, as a rank starts (tests/launch.py sets OMP_NUM_THREADS=1, as torchrun does): numpy's
    # OpenBLAS reads it at import and otherwise starts a thread per core, and a process with more than
    # one thread is not forked from (tests/launch.py then starts every rank fresh)
    os.environ["OMP_NUM_THREADS"] = "1"
    # pyarrow's jemalloc starts a background thread when it loads (DeepSpeed's autotuner imports
    # mlflow where it is installed, and mlflow pandas and pyarrow): without it, as the ranks run
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    _odb_first()
    _imports()
    gc.freeze()  # the imported objects: a rank's collector never walks them (writing to their pages copies them)

    def say(message: dict) -> None:
        os.write(channel, (json.dumps(message) + "\n").encode())

    # forking is safe only from a single thread: say how many there are (tests/launch.py uses none else)
    say({"ready": os.getpid(), "threads": len(os.listdir("/proc/self/task"))})
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:  # the test process is gone: so are we (its ranks were its to end)
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _rank(request, channel)
                children.add(pid)
                say({"pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
