"""The run's data as the run reads it: the training and validation datasets of every source
(:func:`build_datasets`: a seeded ``--val_ratio`` share held out, or ``--eval_data``), and a
streaming source's per-rank reader (:func:`streaming_reader`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from odb.batching.config import OdbConfig
from odb.data.mixture import MixedDataset, SourceSpec
from odb.data.processing import SampleDataset
from odb.data.row_groups import CACHED_GROUPS
from odb.data.streaming import ShardReader
from odb.training.config.settings import RunConfig

__all__ = ["build_datasets", "streaming_reader"]


def streaming_reader(config: RunConfig, batching: OdbConfig, dataset: SampleDataset, world_size: int,
                     log: Callable[[str], None]) -> tuple[OdbConfig, ShardReader, int]:
    """A streaming source's batching (static shards: each rank reads its own), this rank's reader,
    and the records of one pass as the schedule plans them (an estimate, the same on every rank).
    ``world_size``: the data-parallel ranks (sequence-parallel groups read as one)."""
    shards = dataset.source
    batching = dataclasses.replace(batching, sharding="static")
    records = shards.estimate_records()
    log(f"odb: streaming {len(shards.files)} shard(s) of {config.data.path}, about {records} records a pass "
        f"(Parquet rows counted, JSONL lines estimated from samples of each shard: the learning-rate schedule's "
        f"length); each rank reads its own shards through a buffer of {config.data.shuffle_buffer} records")
    rows, decoded = shards.largest_row_group()
    if rows:
        log(f"odb: the largest Parquet row group holds {rows} rows ({decoded / 2**20:.0f} MiB decoded); a "
            f"DataLoader worker decodes the row group of each record it reads and keeps the last {CACHED_GROUPS}")
    idle = world_size - len(shards.files)
    if idle > 0:
        log(f"odb: WARNING: {len(shards.files)} shard(s) for {world_size} data-parallel ranks: {idle} of them read "
            "nothing each pass and only join the others' steps; split the data into at least as many shards as ranks")
    reader = ShardReader(shards, seed=batching.seed, buffer_size=config.data.shuffle_buffer)
    return batching, reader, records


def build_datasets(config: RunConfig, tokenizer, vision, *, truncate_to: int | None
              ) -> tuple[SampleDataset, SampleDataset | None]:
    """The training data and the validation data (``--eval_data``, or a seeded ``--val_ratio``
    share of ``--data`` that training then leaves out), processed alike but for augmentation,
    which validation never applies, and for ``truncate_to``: validation samples stay whole (the
    evaluator scores one over the cap in a forward of its own), so the eval loss does not depend
    on ``max_tokens``."""
    data = config.data
    sources = data.sources or (SourceSpec("data", data.path),)
    train, held_out = [], []
    for number, source in enumerate(sources):
        processing = dataclasses.replace(data.processing, **source.processing)
        plain = dataclasses.replace(processing, system_prompt_prob=0.0, turn_sampling=False)
        common = {"seed": config.seed + 7919 * number, "truncate_to": truncate_to, "vision": vision,
                  "cache_dir": config.output_dir}
        whole = {**common, "truncate_to": None}
        dataset = SampleDataset(source.path, tokenizer, processing, max_samples=data.max_samples,
                                streaming=data.streaming, **common)
        if data.val_ratio:  # each source's own seeded share held out
            size = len(dataset)
            held = max(1, round(size * data.val_ratio))
            if held >= size:
                raise ValueError(f"--val_ratio {data.val_ratio} of {size} records of {source.path} leaves nothing "
                                 "to train on; lower it or pass --eval_data")
            order = np.random.default_rng(config.seed + 7919 * number).permutation(size)
            val, kept = sorted(order[:held].tolist()), sorted(order[held:].tolist())
            dataset = SampleDataset(source.path, tokenizer, processing, indices=kept, **common)
            held_out.append((source.name, SampleDataset(source.path, tokenizer, plain, indices=val, **whole)))
        train.append((source.name, dataset))
    if data.eval_path is not None:
        plain = dataclasses.replace(data.processing, system_prompt_prob=0.0, turn_sampling=False)
        whole = {"seed": config.seed, "truncate_to": None, "vision": vision, "cache_dir": config.output_dir}
        held_out = [(s.name, SampleDataset(s.path, tokenizer, dataclasses.replace(plain, **s.processing), **whole))
                    for s in data.eval_sources or (SourceSpec("data", data.eval_path),)]

    def joined(parts, named: bool):  # named sources keep their names, even one
        return MixedDataset(parts) if named or len(parts) > 1 else parts[0][1]

    return (joined(train, bool(data.sources)),
            joined(held_out, bool(data.eval_sources if data.eval_path is not None else data.sources))
            if held_out else None)
