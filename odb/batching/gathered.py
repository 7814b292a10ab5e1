"""The round's gathered proposals, as the decision reads them: every rank's vector decoded
(:func:`odb.batching.wire.proposal_layout`) and cut to the columns in use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from odb.batching.wire import PROPOSAL_SCALARS

__all__ = ["Gathered", "first_bins", "round_up", "unpack"]


class Gathered(NamedTuple):
    """The gathered proposals, cut to the columns in use (``B``: the most bins any rank holds,
    ``S``: the most samples)."""

    fields: Mapping[str, np.ndarray]  # each of PROPOSAL_SCALARS -> [world]
    costs: np.ndarray  # [world, B] per ranked bin
    samples: np.ndarray  # [world, B]
    tokens: np.ndarray  # [world, B]
    labels: np.ndarray  # [world, B]
    sample_labels: np.ndarray | None  # [world, S] per sample, bin after bin: quota mode only
    sample_tokens: np.ndarray | None  # [world, S], quota mode only
    sample_costs: np.ndarray | None  # [world, S], quota mode only

    @property
    def num_bins(self) -> np.ndarray:
        return self.fields["num_bins"]


def unpack(fields: Mapping[str, np.ndarray]) -> Gathered:
    """The decoded proposals of every rank (``fields``), cut to the bins and samples some rank holds."""
    used_bins = int(fields["num_bins"].max())
    per_bin = (fields[name][:, :used_bins] for name in ("bin_costs", "bin_samples", "bin_tokens", "bin_labels"))
    costs, samples, tokens, labels = per_bin
    used = int(samples.sum(axis=1).max()) if used_bins and "sample_labels" in fields else 0
    per_sample = [fields[name][:, :used] if name in fields else None
                  for name in ("sample_labels", "sample_tokens", "sample_costs")]
    return Gathered({name: fields[name] for name in PROPOSAL_SCALARS}, costs, samples, tokens, labels, *per_sample)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def first_bins(take: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``[world, B]`` mask of each rank's first ``take[r]`` ranked bins."""
    return np.arange(like.shape[1])[None, :] < take[:, None]


# ---- phase 4: which bin at which slot ----------------------------------------------------------
