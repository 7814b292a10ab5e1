"""One rank's run, built in one place: the process group, then every component in order.

:func:`init_distributed` joins the process group (one rank on this machine without a launcher);
:func:`build_components` builds what a run is made of (:class:`Components`), in the same order on
every rank, because several steps are collective (DeepSpeed's initialization, the batcher's
settings check). Nothing here starts a process: the feed's DataLoader workers start at the first
fetch, in the train loop.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from odb.batching.align import SequenceGroups, TorchCommunicator
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import AUTO, OdbConfig, gas_for_tokens
from odb.batching.mixture import Mixture
from odb.data.feed import SampleFeed
from odb.data.processing import SampleDataset, sample_sizes
from odb.telemetry import Telemetry
from odb.telemetry.trackers import RunInfo, Trackers
from odb.training import backends
from odb.training.backends import Backend
from odb.training.backends.process_group import collective_timeout_s
from odb.training.config.objective import padded_refusal
from odb.training.config.settings import RunConfig
from odb.training.model.build import flops_model, hf_model, load_tokenizer, vision_spec
from odb.training.model.mrope import supports_packing
from odb.training.run.datasets import build_datasets, mixture_epoch, streaming_reader
from odb.training.run.evaluate import Evaluator
from odb.training.run.preflight import PreflightReport, run_preflight
from odb.training.run.reference import reference_datasets, reference_engine
from odb.training.run.schedule import ProgressSchedule
from odb.training.run.startup import StartupError, probed_attention
from odb.training.run.waits import announced_wait
from odb.training.run.watchdog import Watchdog, WatchedCommunicator
from odb.training.step.engine import BLANK_IMAGE_TOKENS, OdbEngine
from odb.training.step.objectives import objective_of
from odb.training.step.sequence_parallel import SequenceParallel, long_sample_degrees, setup_groups
from odb.training.step.sequence_parallel import setup as setup_sequence_parallel

__all__ = ["Components", "build_backend", "build_components", "init_distributed", "port_in_use"]


@dataclass(frozen=True, kw_only=True)
class Components:
    """Everything one rank's run is made of."""

    rank: int
    world_size: int
    config: RunConfig
    """The run's config as it runs: ``max_tokens`` / ``max_patches`` 'auto' resolved by the preflight."""
    batching: OdbConfig
    """odb's settings as this model runs them (room for a blank image, padded rows)."""
    tokenizer: Any
    engine: OdbEngine
    dataset: SampleDataset
    feed: SampleFeed
    comm: TorchCommunicator
    batcher: OnlineBatcher
    schedule: ProgressSchedule
    telemetry: Telemetry
    settings: dict[str, Any]
    """The effective settings, logged at start and sent to the trackers."""
    preflight: PreflightReport | None
    """What the preflight measured (None with ``--preflight off``)."""
    evaluator: Evaluator | None
    """The validation loss over ``--eval_data`` or the ``--val_ratio`` split, or None."""
    trackers: Trackers
    """Rank 0's trackers (``--report_to``; none on the other ranks), opened by the run once it
    knows its first step (:meth:`odb.telemetry.trackers.Trackers.start`)."""
    sequence_parallel: SequenceParallel | None = None
    """This rank's sequence-parallel group (``--sequence_parallel_size`` > 1), or None."""

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel rank: its sequence-parallel group's index (its rank without)."""
        return self.rank // self.sequence_parallel.size if self.sequence_parallel else self.rank

    @property
    def data_world(self) -> int:
        """The data-parallel ranks: the sequence-parallel groups (the ranks without)."""
        return self.world_size // self.sequence_parallel.size if self.sequence_parallel else self.world_size

    @property
    def writes_data_files(self) -> bool:
        """Whether this rank writes its data-parallel rank's files (batcher state, audit lines): one
        rank of each sequence-parallel group, whose ranks run the same plans."""
        return self.sequence_parallel is None or self.sequence_parallel.member == 0


def init_distributed(config: RunConfig) -> tuple[int, int]:
    """Joins the process group (as the backend does); returns ``(rank, world_size)``."""
    import torch.distributed as dist

    if "RANK" not in os.environ:  # ``python launch/train.py`` without a launcher: one rank here
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the machine's cores instead of each taking all of them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # a backstop: the watchdog (odb.training.run.watchdog) ends a stalled run first, naming the rank
    timeout_s = collective_timeout_s(config.run.dist_timeout_s)
    backend = backends.get(config.optimization.backend)
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    what = backend.JOINING + \
        f"the other ranks to join the process group ({os.environ.get('WORLD_SIZE')} ranks, rendezvous at {address})"
    check = (f"every rank must be started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE and reach {address} "
             f"(a firewall, another job on that port); the process group gives up after {timeout_s:.0f} s")
    with announced_wait(what, check, timeout_s=config.run.dist_timeout_s):
        try:
            backend.init_distributed(timeout_s)
        except dist.DistNetworkError as error:
            if "EADDRINUSE" not in str(error):
                raise
            raise StartupError(port_in_use(os.environ.get("MASTER_PORT", "?"))) from error
    return dist.get_rank(), dist.get_world_size()


def port_in_use(port: str) -> str:
    """The fix for a rendezvous port another process holds (rank 0 cannot open the process group's
    store there; the other ranks of this run would join that process's store and wait)."""
    from odb.training.config.environment import free_port

    return (f"MASTER_PORT {port} is in use on this host (another run holds it), so this run's process group "
            f"cannot open its rendezvous there: start this run on a free port (e.g. {free_port()}): "
            "deepspeed --master_port <port> launch/train.py ..., torchrun --master_port <port> ..., "
            "or export MASTER_PORT=<port> under srun; odb train picks a free port itself")


def build_components(config: RunConfig, *, rank: int, world_size: int, report: Callable[[], np.ndarray],
                     on_reports: Callable[[np.ndarray], None], log: Callable[[str], None],
                     watchdog: Watchdog | None = None, load: Any = None,
                     backend: Backend | None = None, reference: Backend | None = None) -> Components:
    """Builds the run (collective: every rank, same order).

    Args:
        report / on_reports: the batcher's telemetry hooks (called from its first round on).
        log: rank 0's console.
        watchdog: told when odb's collective waits on the other ranks.
        load: a resume's plan (the backend's ``plan_load``: a universal checkpoint's DeepSpeed
            config), which the backend is built for.
        backend: the model as a host's own loop runs it (:mod:`odb.integrations`), instead of one
            built here from ``config``.
        reference: a host's separate reference model, as the host runs it (a preference
            objective's reference ``model``: :data:`odb.training.config.objective.HOST_REFERENCES`).
    """
    tokenizer = load_tokenizer(config.model.tokenizer)
    host_backend = backend is not None
    if backend is None:
        backend = build_backend(config, rank=rank, vocab_size=len(tokenizer), load=load)
    model = hf_model(backend.module)
    vision = vision_spec(model, config.data.processing, source=config.model.path)
    packed = supports_packing(model)
    if not packed and config.objective.is_preference:
        raise ValueError(padded_refusal(config.objective.objective, f"odb cannot pack {model.config.model_type}"))
    comm = TorchCommunicator(timeout_s=collective_timeout_s(config.run.dist_timeout_s))
    watched = comm if watchdog is None else WatchedCommunicator(comm, watchdog)
    sp, size = None, config.model.sequence_parallel_size
    if size > 1:
        if host_backend:
            raise ValueError("--sequence_parallel_size: odb's sequence parallelism runs in odb's own loop (launch/"
                             "train.py); a host's loop (HF Trainer, TRL, Accelerate) has its own (e.g. TRL's sp_size)")
        if not packed:
            raise ValueError(f"--sequence_parallel_size splits packed rows, and odb cannot pack "
                             f"{model.config.model_type}: train it with sequence_parallel_size 1")
        sp = setup_sequence_parallel(model, size, rank=rank, world_size=world_size)
    groups = _long_sample_groups(config, model, host_backend=host_backend, packed=packed, rank=rank,
                                 world_size=world_size)
    batcher_comm = watched if sp is None else SequenceGroups(watched, size)
    measured = None
    if config.preflight.preflight == "on":
        if watchdog is not None:
            watchdog.progress("preflight: the worst-case step")
        measured = run_preflight(config, backend, watched, tokenizer=tokenizer, vision=vision, packed=packed,
                                 world_size=world_size, log=log, sequence_parallel=sp, groups=groups, rank=rank)
        budgets = {"max_tokens": measured.max_tokens}
        if config.batching.max_patches == AUTO:
            budgets["max_patches"] = measured.max_patches
        config = dataclasses.replace(config, batching=dataclasses.replace(config.batching, **budgets))
    batching = config.batching
    if sp is not None:  # the batcher plans a group's micro-batches: S ranks' budgets
        batching = dataclasses.replace(batching, max_tokens=batching.max_tokens * size)
        log(f"odb: sequence parallelism: {world_size // size} group(s) of {size} ranks; a micro-batch holds up to "
            f"{size} x {config.batching.max_tokens} = {batching.max_tokens} tokens, each rank 1/{size} of every row "
            "(DeepSpeed Ulysses attention)")
    if vision is not None:
        # a micro-batch without images carries a 3-token blank image (odb/training/step/engine.py): keep room
        batching = dataclasses.replace(batching, max_tokens=batching.max_tokens - BLANK_IMAGE_TOKENS)
        log(f"odb: vision model: samples packed under max_tokens - {BLANK_IMAGE_TOKENS} "
            f"= {batching.max_tokens} (room for the blank image of imageless micro-batches)")
    if batching.global_batch_tokens is not None:
        batching = _gas_from_tokens(batching, world_size // size, log, packed=packed)
        config = _with_gas(config, batching.gas, backend)
    if batching.over_cap == "sequence_parallel":
        degrees = tuple(groups)
        if degrees:
            log(f"odb: over_cap sequence_parallel: a sample over max_tokens {batching.max_tokens} trains whole on a "
                f"group of {' or '.join(map(str, degrees))} consecutive ranks (up to {degrees[-1]} x "
                f"{batching.max_tokens} = {degrees[-1] * batching.max_tokens} tokens; longer ones are truncated to "
                "that), each rank 1/d of it (DeepSpeed Ulysses attention); the other ranks train their own "
                "micro-batches meanwhile")
        else:
            log(f"odb: WARNING: over_cap sequence_parallel on {world_size} rank(s): no group of ranks to share a "
                f"long sample (groups: powers of two up to max_sp {batching.max_sp} that divide the ranks); samples "
                f"over max_tokens {batching.max_tokens} are truncated to it")
    long_cap = batching.max_tokens * max(groups, default=1)
    what = f"the data {config.data.path} to be indexed"
    check = f"a big file on network storage takes time; if this does not move, check it answers: ls {config.data.path}"
    with announced_wait(what, check, timeout_s=config.run.dist_timeout_s):
        dataset, eval_dataset = build_datasets(config, tokenizer, vision,
                                          truncate_to=long_cap if batching.over_cap in ("truncate", "sequence_parallel")
                                          else None)
    if not packed:
        log(f"odb: cannot pack {model.config.model_type} correctly (its rotary positions are "
            "unknown to odb): training on PADDED micro-batches instead, each within "
            f"rows x longest <= {batching.max_tokens} tokens")
        if batching.policy == "odb":
            batching = dataclasses.replace(batching, pad_rows=True)
    reference_model = None if reference is None else reference_engine(config, reference, batching, tokenizer)
    engine = OdbEngine(backend, world_size=world_size,
                       max_tokens=batching.max_tokens, pad_token_id=tokenizer.pad_token_id, packed=packed,
                       loss_chunk_tokens=None if config.objective.scores else config.model.loss_chunk_tokens,
                       sequence_parallel=sp, groups=groups, rank=rank, objective=objective_of(config, reference_model))
    # (--reference precompute: the samples carry the initial weights' log-probs, from a pass made here or loaded)
    fed, eval_fed = reference_datasets(config, engine, dataset, eval_dataset, batching, batcher_comm, log)
    feed = SampleFeed(fed, sample_sizes, num_workers=config.data.num_workers,
                      prefetch_factor=config.data.prefetch_factor)
    evaluator = None if eval_dataset is None else Evaluator(
        engine, eval_fed, batching, batcher_comm, num_workers=config.data.num_workers,
        prefetch_factor=config.data.prefetch_factor)
    mixture, reader, records = None, None, len(dataset)
    if config.data.streaming:
        batching, reader, records = streaming_reader(config, batching, dataset, world_size // size, log)
    if config.data.is_weighted and not config.data.streaming:  # (a streamed mixture is its reader's)
        if rank == 0:
            print(mixture_epoch(config, list(dataset.sizes), list(dataset.source_names)), file=sys.stderr, flush=True)
        mixture = Mixture(dataset.sizes, [s.weight for s in config.data.sources], mix_by=config.data.mix_by,
                          epoch_rule=config.data.mix_epoch, seed=batching.seed, quota=batching.mode == "quota")
    batcher = OnlineBatcher(batching, batcher_comm, dataset_size=len(dataset), feed=feed, num_epochs=config.run.epochs,
                            report=report, on_reports=on_reports, mixture=mixture, reader=reader,
                            settings=shared_settings(config, model.config, dataset, eval_dataset))
    planned = batching.quota if batching.mode == "quota" else config.run.epochs * records
    schedule = ProgressSchedule(config.optimization.lr, planned, warmup_ratio=config.optimization.warmup_ratio)
    settings = _settings(config, batching, world_size=world_size, packed=packed, dataset_size=records,
                         planned=planned)
    settings["eval_samples"] = len(eval_dataset) if eval_dataset is not None else 0
    trackers = Trackers(config.logging.report_to if rank == 0 else (), _run_info(config, settings, batching))
    flops = flops_model(backend.module, backend.device, backends.get(config.optimization.backend).compute_dtype(
        config.optimization))
    if sp is not None and flops is not None and flops.peak_flops:  # a telemetry rank is a group: S devices
        flops = dataclasses.replace(flops, peak_flops=flops.peak_flops * size)
    telemetry = Telemetry(rank=rank, max_steps_per_round=batcher.capacity // batching.gas + 1,
                          max_tokens=batching.max_tokens, dataset_size=0 if reader else len(dataset),
                          output_dir=config.output_dir, sink=trackers.log if trackers else None, flops=flops,
                          mixture=mixture is not None)  # (a stream's 0 records: epochs from the plans as well)
    return Components(rank=rank, world_size=world_size, config=config, batching=batching, tokenizer=tokenizer,
                      engine=engine, dataset=dataset, feed=feed, comm=comm, batcher=batcher, schedule=schedule,
                      telemetry=telemetry, settings=settings, preflight=measured, trackers=trackers,
                      evaluator=evaluator, sequence_parallel=sp)


def _gas_from_tokens(batching: OdbConfig, ranks: int, log: Callable[[str], None], *, packed: bool = True
                     ) -> OdbConfig:
    """``batching`` with the gas that makes an optimizer step carry about ``global_batch_tokens``
    on ``ranks`` data-parallel ranks at the budget now in effect (:func:`gas_for_tokens`; the fill:
    ``min_fill``, what the packer fills a bin to at least). DeepSpeed's own
    ``gradient_accumulation_steps`` is not used for training: odb sets each step's boundary."""
    if batching.policy != "odb" or not packed:
        what = f"policy {batching.policy!r} pads its batches" if packed else "this model trains padded rows"
        raise ValueError(f"--global_batch_tokens derives gas from odb's packed fill, and {what}: set --gas instead")
    gas = gas_for_tokens(batching.global_batch_tokens, ranks, batching.max_tokens, batching.min_fill)
    if gas > batching.window:
        raise ValueError(f"--global_batch_tokens {batching.global_batch_tokens} needs gas {gas} on {ranks} rank(s) of "
                         f"{batching.max_tokens} tokens, more than --window {batching.window}: raise --window to "
                         f"{gas} or more, or lower --global_batch_tokens")
    about = round(gas * ranks * batching.max_tokens * batching.min_fill)
    log(f"odb: global_batch_tokens {batching.global_batch_tokens}: gas {gas} on {ranks} rank(s) of up to "
        f"{batching.max_tokens} tokens a micro-batch (about {about} tokens a step; summary.json reports what the "
        "steps carried)")
    return dataclasses.replace(batching, gas=gas)


def _with_gas(config: RunConfig, gas: int, backend: Backend) -> RunConfig:
    """The run's config with the gas derived from ``global_batch_tokens`` where the configured one
    was: odb's settings (``run_config.json``, ``summary.json``, the trackers) and the backend's
    (DeepSpeed's ``gradient_accumulation_steps``, what it logs and saves with its checkpoints)."""
    module = backends.get(config.optimization.backend)
    return dataclasses.replace(config, batching=dataclasses.replace(config.batching, gas=gas),
                               optimization=module.set_gas(config.optimization, backend, gas))


def _long_sample_groups(config: RunConfig, model, *, host_backend: bool, packed: bool, rank: int,
                        world_size: int) -> dict[int, SequenceParallel]:
    """over_cap 'sequence_parallel': this rank's group of each size that may train a long sample
    together (collective: every rank forms every group), or none."""
    batching = config.batching
    if batching.over_cap != "sequence_parallel":
        return {}
    fix = "set --over_cap truncate"
    if host_backend:
        raise ValueError("--over_cap sequence_parallel runs in odb's own loop (launch/train.py); a host's loop (HF "
                         f"Trainer, TRL, Accelerate) trains each rank's micro-batch alone: {fix}")
    if config.model.sequence_parallel_size > 1:
        raise ValueError("--over_cap sequence_parallel shares long samples between ranks per micro-batch, and "
                         "--sequence_parallel_size splits every row: use one of them")
    if not packed:
        raise ValueError(f"--over_cap sequence_parallel splits a long sample's packed row, and odb cannot pack "
                         f"{model.config.model_type}: {fix}")
    degrees = long_sample_degrees(model, batching.max_sp, world_size)
    return setup_groups(model, degrees, rank=rank, world_size=world_size)


def build_backend(config: RunConfig, *, rank: int, vocab_size: int, load: Any = None) -> Backend:
    """The model, its optimizer and its collectives under the run's backend (collective; ``load``: a
    resume's plan, the backend's ``plan_load``)."""
    backend = backends.get(config.optimization.backend)
    model_settings = config.model
    what = f"the model {model_settings.path} to load and {backend.NAME} to set it up"
    check = (f"a large model on network storage takes minutes; if this does not move, check that the storage answers "
             f"(ls {model_settings.path}) and the memory (free -g); the other ranks wait here too")
    with announced_wait(what, check, timeout_s=config.run.dist_timeout_s, on_exit=backend.release):
        return backend.build(config, rank=rank, vocab_size=vocab_size, load=load)


def shared_settings(config: RunConfig, model_config, dataset: SampleDataset,
                    eval_dataset: SampleDataset | None) -> dict[str, Any]:
    """What every rank must share besides odb's batching settings, checked in the batcher's first
    collective: a rank started with other flags, files, data, model or odb fails at start, naming
    the keys, instead of hanging or training something else later."""
    import odb

    model = {k: v for k, v in model_config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return {
        "odb_version": odb.__version__,
        "backend": config.optimization.backend,
        **backends.get(config.optimization.backend).shared_settings(config.optimization),
        "optimizer": {k: v for k, v in dataclasses.asdict(config.optimization).items() if k not in backends.NAMES},
        "model.config": model,
        "model.lora": config.model.lora,
        "model.gradient_checkpointing": config.model.gradient_checkpointing,
        "model.loss_chunk_tokens": config.model.loss_chunk_tokens,
        "model.sequence_parallel_size": config.model.sequence_parallel_size,
        "data.fingerprint": dataset.fingerprint(),
        "data.processing": dataclasses.asdict(config.data.processing),
        "data.streaming": [config.data.streaming, config.data.shuffle_buffer],
        "data.sources": [[s.name, s.weight, dict(s.processing)] for s in config.data.sources],
        "data.image_processor": dataclasses.asdict(dataset.vision) if dataset.vision is not None else None,
        "data.eval_fingerprint": eval_dataset.fingerprint() if eval_dataset is not None else None,
        "data.eval_steps": config.data.eval_steps,
        "run": {"epochs": config.run.epochs, "max_steps": config.run.max_steps,
                "dist_timeout_s": config.run.dist_timeout_s},
        "checkpoints": {"save_steps": config.checkpoints.save_steps, "resume": config.checkpoints.resume,
                        "final": config.checkpoints.final, "save_hf": config.checkpoints.save_hf},
    }


def _settings(config: RunConfig, batching: OdbConfig, *, world_size: int, packed: bool, dataset_size: int,
              planned: int) -> dict[str, Any]:
    attention = probed_attention(config) if packed else "padded (sdpa)"  # (probed before the process group)
    backend = backends.get(config.optimization.backend).describe(config.optimization)
    return {"world_size": world_size, "max_tokens": batching.max_tokens, "window": batching.window,
            "gas": batching.gas, "mode": batching.mode, "policy": batching.policy, **backend, "attention": attention,
            "model": config.model.path, "lora": bool(config.model.lora),
            "gradient_checkpointing": config.model.gradient_checkpointing,
            "loss_chunk_tokens": config.model.loss_chunk_tokens,
            "sequence_parallel_size": config.model.sequence_parallel_size, "data": config.data.path,
            "dataset_samples": dataset_size, "streaming": config.data.streaming, "epochs": config.run.epochs,
            "planned_samples": planned,
            "lr": config.optimization.lr, "num_workers": config.data.num_workers}


def _run_info(config: RunConfig, settings: dict[str, Any], batching: OdbConfig) -> RunInfo:
    """What the trackers are told of the run: its name, and the effective, odb and backend settings."""
    import odb

    log, optimization = config.logging, config.optimization
    params = {**settings, "odb": batching.to_dict(), "deepspeed": dict(optimization.deepspeed),
              "fsdp2": dataclasses.asdict(optimization.fsdp2) if optimization.fsdp2 else None}
    return RunInfo(output_dir=config.output_dir, name=log.run_name or config.output_dir.name, params=params,
                   resume=config.checkpoints.resume is not None, wandb_project=log.wandb_project,
                   wandb_tags=log.wandb_tags, odb_version=odb.__version__)
