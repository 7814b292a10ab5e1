"""How odb imports: an import it keeps out of its processes, and a package's names read lazily.

DeepSpeed's autotuner's ``import mlflow``.

DeepSpeed imports its autotuner whenever it is imported, and the autotuner imports mlflow where it
is installed, for a feature odb never runs. mlflow brings pandas and pyarrow: about 2.7 s of CPU
per process here (``import deepspeed`` 4.3 s without it, 7 s with it), some hundred MB in every
rank, and pyarrow's allocator thread, which every forked DataLoader worker inherits half-made.
:func:`install` (run by ``import odb``, before anything of odb imports DeepSpeed) makes that one
import fail, as where mlflow is not installed (the autotuner catches it); every other import of
mlflow, odb's MLflow tracker's included (``odb.telemetry.trackers``), is left alone.

:func:`lazy_exports` lets a package offer its modules' public names (``from odb.training.config
import RunConfig``, the path of the releases before the re-cut into packages) without importing
any of them until one is read: importing one light module of the package stays light."""

from __future__ import annotations

import importlib
import os
import sys
from importlib.abc import MetaPathFinder

__all__ = ["install", "lazy_exports"]

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


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """``__all__`` and the module ``__getattr__`` (PEP 562) for ``package``, whose submodule ``m``
    offers the names ``exports[m]``; a name is imported from its module when first read."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return sorted(where), __getattr__
