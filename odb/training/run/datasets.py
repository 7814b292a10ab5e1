"""The run's data as the run reads it: the training and validation datasets of every source
(:func:`build_datasets`: a seeded ``--val_ratio`` share held out, or ``--eval_data``), a
streaming source's per-rank reader (:func:`streaming_reader`), and a mixture's mean units per
record from a seeded probe of each source (:func:`mean_units`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from odb.batching.config import OdbConfig
from odb.batching.cost import CostModel
from odb.batching.mixture import epoch_records
from odb.batching.stream import Reader
from odb.batching.stream_mixture import MixedReader
from odb.data.mixture import MixedDataset, SourceSpec
from odb.data.processing import SampleDataset, sample_sizes
from odb.data.row_groups import CACHED_GROUPS
from odb.data.streaming import ShardReader
from odb.training.config.settings import RunConfig

__all__ = ["LARGE_EPOCH", "PROBE_RECORDS", "build_datasets", "mean_units", "mixture_epoch", "streaming_reader"]

LARGE_EPOCH = 2.0
"""A weighted epoch this many times the data's records or more is warned of at start."""
PROBE_RECORDS = 64
"""Records of each source :func:`mean_units` processes."""


def streaming_reader(config: RunConfig, batching: OdbConfig, dataset: SampleDataset | MixedDataset, world_size: int,
                     log: Callable[[str], None]) -> tuple[OdbConfig, Reader, int]:
    """A streaming source's batching (static shards: each rank reads its own), this rank's reader,
    and the records of one pass as the schedule plans them (an estimate, the same on every rank).
    Weighted sources: a streamed mixture (:class:`odb.batching.stream_mixture.MixedReader`), whose
    every source needs a shard for each rank. ``world_size``: the data-parallel ranks
    (sequence-parallel groups read as one)."""
    batching = dataclasses.replace(batching, sharding="static")
    parts = dataset.parts if isinstance(dataset, MixedDataset) else [dataset]
    readers, records = [], []
    for number, (name, part) in enumerate(zip(dataset.source_names, parts)):
        shards = part.source
        records.append(shards.estimate_records())
        where = config.data.path if len(parts) == 1 else f"source {name!r}"
        log(f"odb: streaming {len(shards.files)} shard(s) of {where}, about {records[-1]} records a pass (Parquet "
            f"rows counted, JSONL lines estimated from samples of each shard: the learning-rate schedule's length); "
            f"each rank reads its own shards through a buffer of {config.data.shuffle_buffer} records")
        rows, decoded = shards.largest_row_group()
        if rows:
            log(f"odb: the largest Parquet row group holds {rows} rows ({decoded / 2**20:.0f} MiB decoded); a "
                f"DataLoader worker decodes the row group of each record it reads and keeps the last {CACHED_GROUPS}")
        idle = world_size - len(shards.files)
        if idle > 0 and len(parts) > 1:
            raise ValueError(f"a streamed mixture draws every source on every data-parallel rank, each from its own "
                             f"shards, and source {name!r} has {len(shards.files)} shard(s) for {world_size} ranks: "
                             f"split it into at least {world_size} shards (or drop --streaming to index it)")
        if idle > 0:
            log(f"odb: WARNING: {len(shards.files)} shard(s) for {world_size} data-parallel ranks: {idle} of them read "
                "nothing each pass and only join the others' steps; split the data into at least as many shards as "
                "ranks")
        seed = batching.seed + 7919 * number if len(parts) > 1 else batching.seed
        readers.append(ShardReader(shards, seed=seed, buffer_size=config.data.shuffle_buffer))
    if len(parts) == 1:
        return batching, readers[0], records[0]
    data = config.data
    weights = [s.weight for s in data.sources]
    reader = MixedReader(readers, [len(part) for part in parts], weights, mix_by=data.mix_by,
                         epoch_rule=data.mix_epoch, num_epochs=config.run.epochs)
    planned = sum(epoch_records(records, weights, epoch_rule=data.mix_epoch))
    log(f"odb: a streamed mixture, drawn by {data.mix_by} on each rank from its own shards of each source; the "
        f"schedule plans {planned} records an epoch (the sources' records as if each carried as many {data.mix_by}: "
        f"an estimate, mix_epoch {data.mix_epoch!r})")
    return batching, reader, planned


def build_datasets(config: RunConfig, tokenizer, vision, *, truncate_to: int | None
              ) -> tuple[SampleDataset, SampleDataset | None]:
    """The training data and the validation data (``--eval_data``, or a seeded ``--val_ratio``
    share of ``--data`` that training then leaves out), processed alike but for augmentation,
    which validation never applies, and for ``truncate_to``: validation samples stay whole (the
    evaluator scores one over the cap in a forward of its own), so the eval loss does not depend
    on ``max_tokens``."""
    data = config.data
    reference = config.objective.is_preference and \
        config.objective.reference_for(lora=config.model.lora is not None) == "data"
    sources = data.sources or (SourceSpec("data", data.path),)
    train, held_out = [], []
    for number, source in enumerate(sources):
        processing = dataclasses.replace(data.processing, **source.processing)
        plain = dataclasses.replace(processing, system_prompt_prob=0.0, turn_sampling=False)
        common = {"seed": config.seed + 7919 * number, "truncate_to": truncate_to, "vision": vision,
                  "cache_dir": config.output_dir, "pairs": config.objective.is_preference, "reference": reference}
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
        whole = {"seed": config.seed, "truncate_to": None, "vision": vision, "cache_dir": config.output_dir,
                 "pairs": config.objective.is_preference, "reference": reference}
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
    records = epoch_records(sizes, weights, epoch_rule=config.data.mix_epoch)
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


def mean_units(dataset: MixedDataset, cost_model: CostModel, mix_by: str, *, seed: int,
               records: int = PROBE_RECORDS) -> list[float]:
    """Each source's mean ``mix_by`` units a record (:data:`odb.batching.mixture.MIX_BY`), from up
    to ``records`` of its records in a seeded choice, processed here as a DataLoader worker
    processes them and admitted as the batcher admits them (a skipped or dropped one: 0 units).
    The same on every rank (the same records, processed alike)."""
    means = []
    for source, (start, size) in enumerate(zip(dataset.starts, dataset.sizes)):
        chosen = np.random.default_rng([seed, source, 2]).choice(size, min(size, records), replace=False)
        uids = [start + int(index) for index in chosen]
        samples = [dataset[uid] for uid in uids]
        raw = [None if "skip" in s else sample_sizes(s)._replace(labels=s["labels"].tolist()) for s in samples]
        admitted, _ = cost_model.measure_many(uids, raw)
        units = len(admitted) if mix_by == "samples" else sum(getattr(sample, mix_by) for sample in admitted)
        means.append(units / len(uids))
    return means
