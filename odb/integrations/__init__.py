"""odb inside other training loops: HF ``Trainer`` and TRL (:mod:`odb.integrations.hf`), an
Accelerate loop or any loop of one's own (:mod:`odb.integrations.accelerate`), both over
:mod:`odb.integrations.core`. The host libraries are imported only by the module that needs them."""

from odb.integrations.core import HostMicro, HostRun, HostStep, OdbSettings, host_config

__all__ = ["HostMicro", "HostRun", "HostStep", "OdbSettings", "host_config"]
