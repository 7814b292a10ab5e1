"""Varlen collation: a bin of samples -> one packed row, no padding.

The keys are transformers' own (those ``DataCollatorWithFlattening`` emits), so the batch goes to
the model as it is. Worked example, two samples packed into one row (``T = 5``)::

    sample A: input_ids [a0 a1 a2]  labels [a0 a1 a2]      (labels may hold -100 already)
    sample B: input_ids [b0 b1]     labels [b0 b1]

    input_ids       a0    a1    a2    b0    b1     shape [1, T]
    position_ids     0     1     2     0     1     restart at 0 for every sample
    labels        -100    a1    a2  -100    b1     -100 where a sample begins
    cu_seq_lens_q   [0, 3, 5]  (int32)             sample boundaries for varlen attention
    cu_seq_lens_k   the same tensor                (self-attention: keys are the queries' samples)
    max_length_q    3                              the longest sample (int)
    max_length_k    3

Samples with images add ``pixel_values`` and ``image_grid_thw``, and samples with videos
``pixel_values_videos``, ``video_grid_thw`` (and Qwen2.5-VL's ``second_per_grid_ts``), each
concatenated in sample order (the order of their image or video tokens in the row).

Asked for (``sources=True``), the row also says which source each sample came from: ``sources``,
one int64 per sample (its ``source``, an index into the dataset's ``source_names``; 0 for a
sample without one), beside ``cu_seq_lens_q``; in the example ``sources [s_A, s_B]``.
:func:`token_sources` spreads it over the row's tokens (``s_A s_A s_A s_B s_B``). It is not the
model's: the caller takes it out of the batch before the forward (the per-source loss,
:class:`odb.training.step.sources.SourceSplit`).

The model shifts labels by one (logits at t predict labels[t+1]), so the -100 at ``b0`` keeps the
last token of A from being trained to predict the first token of B; varlen attention over
``cu_seq_lens_q`` (or per-sample masks built from ``position_ids``) keeps B from attending to A.
The loss normalizer is the number of labels != -100: :func:`odb.batching.cost.count_label_tokens`.

:func:`collate_padded` gives the padded layout of the same samples, for the baselines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["collate_packed", "collate_padded", "to_device", "token_sources"]


def _ids_and_labels(sample: Mapping, max_tokens: int | None) -> tuple[list[int], list[int]]:
    ids = sample["input_ids"]
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    labels = sample.get("labels")
    labels = ids if labels is None else (labels.tolist() if isinstance(labels, torch.Tensor) else list(labels))
    if len(labels) != len(ids):
        raise ValueError(f"sample has {len(ids)} input_ids but {len(labels)} labels")
    if not ids:
        raise ValueError("cannot collate an empty sample")
    if max_tokens is not None:
        ids, labels = ids[:max_tokens], labels[:max_tokens]
    return ids, [-100] + labels[1:]


def collate_packed(samples: Sequence[Mapping], *, max_tokens: int | None = None, sources: bool = False
                   ) -> dict[str, torch.Tensor | int]:
    """Packs ``samples`` (each with ``input_ids`` and optional ``labels``) into one row.

    Args:
        samples: the bin's samples, in order.
        max_tokens: truncate each sample to this many tokens (the over-cap policy 'truncate').
        sources: add ``sources``, each sample's source (not a model input: take it out before the
            forward).

    Returns:
        ``input_ids``, ``position_ids``, ``labels`` (each ``[1, T]`` int64), ``cu_seq_lens_q`` and
        ``cu_seq_lens_k`` (one ``[n + 1]`` int32 tensor), ``max_length_q`` and ``max_length_k``
        (int); the images, if any; with ``sources``, ``sources`` ``[n]`` int64.
    """
    if not samples:
        raise ValueError("cannot collate an empty bin")
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    bounds = [0]
    for sample in samples:
        sample_ids, sample_labels = _ids_and_labels(sample, max_tokens)
        ids += sample_ids
        labels += sample_labels
        positions += range(len(sample_ids))
        bounds.append(len(ids))
    cu_seq_lens = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest, "max_length_k": longest,
        **_images(samples), **(_sources(samples) if sources else {}),
    }


def _sources(samples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    return {"sources": torch.tensor([int(s.get("source", 0)) for s in samples], dtype=torch.long)}


def token_sources(batch: Mapping[str, torch.Tensor | int]) -> torch.Tensor:
    """The source of every token of a collated batch with ``sources``: ``[B, T]`` int64, each
    sample's over its own tokens (packed: split at ``cu_seq_lens_q``; padded: one source per row,
    padding included)."""
    sources_n, labels = batch["sources"], batch["labels"]
    assert isinstance(sources_n, torch.Tensor) and isinstance(labels, torch.Tensor), "collate with sources=True"
    bounds = batch.get("cu_seq_lens_q")
    if bounds is None:  # padded rows
        return sources_n[:, None].expand(labels.shape).clone()
    assert isinstance(bounds, torch.Tensor)
    lengths = (bounds[1:] - bounds[:-1]).to(device=sources_n.device, dtype=torch.long)
    return torch.repeat_interleave(sources_n, lengths, output_size=labels.shape[1])[None]


VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def _images(samples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    """Images and videos of the samples, in order: each of :data:`VISION_KEYS` that some sample
    carries, concatenated (``second_per_grid_ts``: Qwen2.5-VL's seconds per temporal patch, one
    per video)."""
    out = {key: torch.cat([torch.as_tensor(s[key]) for s in samples if s.get(key) is not None])
           for key in VISION_KEYS[:4] if any(s.get(key) is not None for s in samples)}
    if any(s.get("second_per_grid_ts") is not None for s in samples):  # one per video, the model's 1.0 where unset
        out["second_per_grid_ts"] = torch.cat([_seconds(s) for s in samples if s.get("video_grid_thw") is not None])
    return out


def _seconds(sample: Mapping) -> torch.Tensor:
    """A sample's seconds per temporal patch, one per video (1.0 each where it has none)."""
    videos = len(sample["video_grid_thw"])
    if sample.get("second_per_grid_ts") is None:
        return torch.ones(videos)
    seconds = torch.as_tensor(sample["second_per_grid_ts"], dtype=torch.float32).reshape(-1)
    if len(seconds) != videos:
        raise ValueError(f"a sample has {videos} video(s) but {len(seconds)} second_per_grid_ts values")
    return seconds


def collate_padded(samples: Sequence[Mapping], *, pad_token_id: int, max_tokens: int | None = None,
                   sources: bool = False) -> dict[str, torch.Tensor]:
    """The same samples as rows padded (on the right) to the longest: ``input_ids``,
    ``attention_mask``, ``position_ids`` and ``labels`` (-100 on padding and first positions),
    each ``[B, L]``; with ``sources``, ``sources`` ``[B]`` (each row's sample's source)."""
    if not samples:
        raise ValueError("cannot collate an empty bin")
    rows = [_ids_and_labels(sample, max_tokens) for sample in samples]
    longest = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, (ids, row_labels) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(ids)] = torch.tensor(row_labels)
        mask[i, :len(ids)] = 1
    positions = torch.arange(longest).expand(len(rows), longest).clone()
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions, "labels": labels,
            **_images(samples), **(_sources(samples) if sources else {})}


def to_device(batch: dict[str, Any], device) -> dict[str, Any]:
    """The batch's tensors on ``device``; one tensor under two keys stays one tensor (the
    attention then sees ``cu_seq_lens_k is cu_seq_lens_q``)."""
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = moved.setdefault(id(value), value.to(device))
        out[key] = value
    return out
