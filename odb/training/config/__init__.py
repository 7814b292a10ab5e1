"""The run's settings: frozen, keyword-only dataclasses grouped as a user thinks of a run
(:mod:`odb.training.config.settings`: :class:`~odb.training.config.settings.RunConfig`; the
optimization's in :mod:`odb.training.config.optimization`), LoRA's checks before peft sees them
(:mod:`~odb.training.config.lora`), and a rank's variables from SLURM's (:mod:`~odb.training.config.environment`).

Plain data, no model and no process group: the flags (:mod:`odb.training.launch.flags`) build a
``RunConfig`` once, every later floor reads it."""

from odb.imports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "settings": ("CheckpointSettings", "DataSettings", "LoggingSettings", "ModelSettings", "PreflightSettings",
                 "RunConfig", "RunSettings"),
    "optimization": ("BACKENDS", "Fsdp2Settings", "OptimizationSettings", "default_lr"),
})
