"""Checkpoint tag folders as a save leaves them, for the tests of what marks one complete (tests only).

odb's files are real: the batcher states of ``world`` simulated ranks, their run states and the
run config, as :func:`odb.training.run.checkpoint.save_checkpoint` writes them. FSDP2's folder is a
real ``torch.distributed.checkpoint`` save (in one process). DeepSpeed's files are the file set of
a real DeepSpeed 0.19.8 save on ``world`` ranks (the names it gives each rank's files, ZeRO-0 to 3,
``bf16_`` under bf16), each a ``torch.save`` zip archive holding the keys odb reads of it
(``dp_world_size``, ``ds_config``): an engine needs a process group, which no unit test joins.
tests/e2e/test_resume_incomplete.py resumes past a real DeepSpeed save cut short.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import SimulatedFeed, run_ranks
from odb.telemetry import Telemetry


def run_config(backend: str, output_dir: Path) -> dict:
    """A run config as ``run_config.json`` holds it (``RunConfig.to_dict``), of ``backend``."""
    from odb.training.config.optimization import Fsdp2Settings, OptimizationSettings
    from odb.training.config.settings import DataSettings, ModelSettings, RunConfig, RunSettings

    optimization = OptimizationSettings(backend=backend, fsdp2=Fsdp2Settings() if backend == "fsdp2" else None)
    return RunConfig(model=ModelSettings(path="m", tokenizer="t"), data=DataSettings(path="d"), batching=OdbConfig(),
                     optimization=optimization, run=RunSettings(output_dir=str(output_dir))).to_dict()


def write_odb_files(tag: Path, *, world: int, backend: str) -> None:
    """odb's files of a checkpoint of ``world`` ranks: real batcher and run states, the run config."""
    samples = [(5 + i % 7, 0) for i in range(40)]
    config = OdbConfig(max_tokens=32, window=8)

    def rank_state(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples))
        next(iter(batcher))
        return batcher.state_dict()

    tag.mkdir(parents=True, exist_ok=True)
    for r, state in enumerate(run_ranks(world, rank_state)):
        (tag / f"odb_state.rank{r}.json").write_text(json.dumps(state))
        # (rank 1's telemetry: rank 0's would open a metrics.jsonl; the run state is the same but its counts)
        telemetry = Telemetry(rank=1, max_steps_per_round=4, max_tokens=32, dataset_size=40, output_dir=tag)
        (tag / f"run_state.rank{r}.json").write_text(json.dumps(telemetry.state_dict({}, {})))
    (tag / "run_config.json").write_text(json.dumps(run_config(backend, tag.parent.parent), indent=2) + "\n")


def deepspeed_files(*, world: int, stage: int, bf16: bool = False) -> list[str]:
    """The names DeepSpeed 0.19.8's save gives a tag's files on ``world`` ranks (rank 0's model
    states first)."""
    model = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3
             else ["mp_rank_00_model_states.pt"])
    optimizer = [f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    return model + (optimizer if stage > 0 or bf16 else [])


def write_deepspeed_files(tag: Path, *, world: int, stage: int, bf16: bool = False) -> list[str]:
    """:func:`deepspeed_files`, written; returns their names."""
    ds_config = {"train_batch_size": 2 * world, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    names = deepspeed_files(world=world, stage=stage, bf16=bf16)
    for name in names:
        if name.endswith("model_states.pt"):
            value = {"module": {"w": torch.randn(8, 8)}, "dp_world_size": world, "mp_world_size": 1,
                     "ds_config": ds_config, "ds_version": "0.19.8"}
        else:
            value = {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.zeros(8, 8)}}}, "ds_config": ds_config}
        torch.save(value, tag / name)
    return names


def write_fsdp2_files(tag: Path) -> list[str]:
    """A real ``torch.distributed.checkpoint`` save into ``tag/fsdp2`` (one process); returns its files."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # ("assuming the intent is to save in a single process": it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.randn(8, 8)}, "optimizer": {"state": {"w": {"exp_avg": torch.zeros(8, 8)}}}},
                 checkpoint_id=tag / "fsdp2")
    return sorted(f"fsdp2/{p.name}" for p in (tag / "fsdp2").iterdir())


def write_tag(folder: Path, tag: str, *, backend: str, world: int = 2, stage: int = 2) -> Path:
    """A complete checkpoint ``folder / tag`` of ``backend`` on ``world`` ranks (DeepSpeed: ZeRO-``stage``)."""
    path = folder / tag
    write_odb_files(path, world=world, backend=backend)
    if backend == "fsdp2":
        write_fsdp2_files(path)
    else:
        write_deepspeed_files(path, world=world, stage=stage)
    return path
