"""The last of a rank's life, after :meth:`odb.training.run.loop.Trainer.shutdown`: leaving the
process group, and ending the process without the interpreter's slow module teardown
(:func:`end_process`); the peak memory the summary reports."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading

__all__ = ["end_process", "leave_process_group", "peak_memory_mb"]


def end_process(code: int) -> None:
    """Ends this process with ``code`` after :meth:`Trainer.shutdown`, as the interpreter's own exit
    begins: other threads that are not daemons are waited for (with the exit hooks of the
    ``threading`` module, which stop idle executor workers), the exit handlers run (temporary
    folders, W&B's service, logging) and Python's and the C library's output buffers are flushed.
    Then the process exits without what the interpreter does last: destroying the modules of torch,
    transformers and DeepSpeed one object at a time, 1-2 s per rank of the tiny run here
    (docs/operations.md), and with them the destructors of objects still alive (a file the run left
    open unflushed would lose its buffer: odb closes its files in the shutdown)."""
    threading._shutdown()  # what Py_Finalize calls first: threading's exit hooks, then joins the threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C-level stdio buffers (a library's printf to a pipe)
    except (OSError, AttributeError):
        pass
    os._exit(code)


def peak_memory_mb() -> float:
    """This process's peak memory: the GPU's allocations on CUDA, else the peak resident set."""
    import resource

    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # Linux: KiB


def leave_process_group() -> None:
    """Leaves the process group, if this process is in one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
