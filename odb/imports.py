"""An import odb keeps out of its processes: DeepSpeed's autotuner's ``import mlflow``.

DeepSpeed imports its autotuner whenever it is imported, and the autotuner imports mlflow where it
is installed, for a feature odb never runs. mlflow brings pandas and pyarrow: about 2.7 s of CPU
per process here (``import deepspeed`` 4.3 s without it, 7 s with it), some hundred MB in every
rank, and pyarrow's allocator thread, which every forked DataLoader worker inherits half-made.
:func:`install` (run by ``import odb``, before anything of odb imports DeepSpeed) makes that one
import fail, as where mlflow is not installed (the autotuner catches it); every other import of
mlflow, odb's MLflow tracker's included (``odb.telemetry.trackers``), is left alone."""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder

__all__ = ["install"]

_AUTOTUNER = os.path.join("deepspeed", "autotuning", "autotuner.py")


class _NoMlflowForTheAutotuner(MetaPathFinder):
    """Refuses ``mlflow`` to an import made by DeepSpeed's autotuner module; finds nothing else."""

    def find_spec(self, name, path=None, target=None):
        if name != "mlflow":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.endswith(_AUTOTUNER):
                raise ModuleNotFoundError("odb keeps mlflow out of DeepSpeed's autotuner (odb/imports.py)",
                                          name=name)
            frame = frame.f_back
        return None


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())
