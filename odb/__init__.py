"""odb: online dynamic batching for DeepSpeed fine-tuning."""

from odb import imports
from odb.batching.align import Aligner, Communicator, SettingsMismatch, SimulatedGroup, TorchCommunicator
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig, load_odb_config
from odb.batching.cost import CostModel, OverCapError, SampleCost
from odb.batching.plan import MicroBatch, StepPlan
from odb.batching.stream import epoch_order

imports.install()  # before anything of odb imports DeepSpeed (odb/imports.py says why)

__all__ = ["Aligner", "Communicator", "CostModel", "MicroBatch", "OdbConfig", "OnlineBatcher",
           "OverCapError", "SampleCost", "SettingsMismatch", "SimulatedGroup", "StepPlan",
           "TorchCommunicator", "epoch_order", "load_odb_config"]

__version__ = "0.1.0"
