"""The run's data as the run reads it: the training and validation datasets of every source
(:func:`build_datasets`: a seeded ``--val_ratio`` share held out, or ``--eval_data``), and a
streaming source's per-rank reader (:func:`streaming_reader`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from odb.batching.config import OdbConfig
from odb.batching.mixture import epoch_records
from odb.data.mixture import MixedDataset, SourceSpec
from odb.data.processing import SampleDataset
from odb.data.streaming import ShardReader
from odb.training.config.settings import RunConfig

__all__ = ["build_datasets", "mixture_epoch", "streaming_reader"]

LARGE_EPOCH = 2.0
"""A weighted epoch this many times the data's records or more is warned of at start."""


def streaming_reader(config: RunConfig, batching: OdbConfig, dataset: SampleDataset, world_size: int,
                     log: Callable[[str], None]) -> tuple[OdbConfig, ShardReader, int]:
    """A streaming source's batching (static shards: each rank reads its own), this rank's reader,
    and the records of one pass as the schedule plans them (an estimate, the same on every rank).
    ``world_size``: the data-parallel ranks (sequence-parallel groups read as one)."""
    shards = dataset.source
    batching = dataclasses.replace(batching, sharding="static")
    records = shards.estimate_records()
    log(f"odb: streaming {len(shards.files)} shard(s) of {config.data.path}, about {records} records a pass "
        f"(estimated from samples of each shard: the learning-rate schedule's length); "
        f"each rank reads its own shards through a buffer of {config.data.shuffle_buffer} records")
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


def mixture_epoch(config: RunConfig, sizes: list[int], names: list[str]) -> str:
    """The line rank 0 prints at the start of a weighted mixture (``sizes``: records per source, as
    ``names``): the epoch's size by source, estimated at equal units per record; a WARNING when it is
    :data:`LARGE_EPOCH` times the data or more (under ``mix_epoch: all`` a tiny, heavily weighted
    source passes again and again to keep its share of the largest source's pass)."""
    weights = [source.weight for source in config.data.sources]
    records = epoch_records(sizes, weights, config.data.mix_epoch)
    total, data = sum(records), sum(sizes)
    parts = ", ".join(f"{name} {n} ({n / size:.3g} x its {size} records)"
                      for name, n, size in zip(names, records, sizes))
    unit = config.data.mix_by
    line = (f"odb: mixture (mix_epoch {config.data.mix_epoch}): an epoch trains about {total} records, "
            f"{total / data:.3g} x the data's {data}: {parts}"
            + ("" if unit == "samples" else f" (at equal {unit} per record; the first rounds measure them)"))
    if config.data.mix_epoch != "all" or total < LARGE_EPOCH * data:
        return line
    most = max(range(len(sizes)), key=lambda i: records[i] / sizes[i])  # the tiny, heavily weighted source
    return (line.replace("odb: mixture", "odb: WARNING: mixture", 1) +
            f". Source {names[most]!r} ({sizes[most]} records at weight {weights[most]:g}) passes about "
            f"{records[most] / sizes[most]:.3g} times: every record of every source trains at least once, so the "
            "smaller sources are up-sampled to their shares of the largest pass. For a shorter epoch: --mix_epoch "
            f"first (every record at most once), a lower weight for {names[most]!r}, "
            "or --max_steps")

