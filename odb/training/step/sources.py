"""A step's figures per data source (a mixture: a packed row may hold samples of several sources).

The token loss sum splits over the sources of the labels as it splits over chunks
(:mod:`odb.training.step.loss`): with ``src(i)`` the source of the sample whose label position
``i`` predicts (inside the same sample: a sample's first label is -100, so no scored position
straddles two samples)::

    loss = sum_s L_s        L_s = sum_{i : src(i) = s} CE(cap(W h_i + b), y_i)

A :class:`SourceSplit` passed to a loss gets each ``L_s`` (detached, fp64) from the very token
losses whose sum is backed; :class:`SourceSums` adds them up over a step's micro-batches, with each
source's label tokens and samples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SourceSplit", "SourceSums", "sample_source"]


class SourceSplit:
    """Where one model call's token losses go by source (the module docstring's per-source sum).

    Args:
        sources_bt: ``[B, T]``, the source of every token (:func:`odb.data.collate.token_sources`),
            on the device of the labels.
        present: the sources of the call's samples (host ints; the sums are as long as the largest + 1).
        shifted: ``sources_bt`` is already the source of the label each position predicts (the
            labels are shifted too: sequence parallelism's slices, :mod:`odb.training.step.sequence_parallel`).
        graph: also keep the sums with their autograd graph (:attr:`graded`): each sample's own
            loss, when every sample of the call is a "source" of its own (preference pairs'
            sequences, :mod:`odb.training.step.preference`).

    Attributes:
        sums: ``[max(present) + 1]`` fp64, detached: each source's summed token loss, once the loss
            has run (0 for a source absent from the call; left at 0 with ``graph``).
        graded: with ``graph``, the sums in fp32 with their gradients, instead (else None).
    """

    def __init__(self, sources_bt: torch.Tensor, present: Sequence[int], *, shifted: bool = False,
                 graph: bool = False) -> None:
        self.sources_bt = sources_bt
        self.shifted = shifted
        self.present = tuple(sorted(set(present)))
        self.sums = torch.zeros(max(self.present) + 1, dtype=torch.float64, device=sources_bt.device)
        self.graded = torch.zeros(len(self.sums), device=sources_bt.device) if graph else None

    def predicted(self) -> torch.Tensor:
        """``[B, T]``: the source of the label each position predicts (``t + 1``; 0 at the last)."""
        if self.shifted:
            return self.sources_bt
        out = torch.zeros_like(self.sources_bt)
        out[:, :-1] = self.sources_bt[:, 1:]
        return out

    def add(self, sources_n: torch.Tensor, losses_n: torch.Tensor) -> None:
        """Adds token losses ``[n]`` into their sources ``[n]``: detached into :attr:`sums`, or with
        ``graph`` into :attr:`graded` alone (what the caller reads then)."""
        if self.graded is not None:  # (out of place: the graph keeps each step)
            self.graded = self.graded.index_add(0, sources_n, losses_n.float())
        else:
            self.sums.index_add_(0, sources_n, losses_n.detach().double())

    def add_total(self, source: int, loss: torch.Tensor) -> None:
        """Adds one source's summed loss (a fused loss run on that source's tokens alone)."""
        self.add(torch.tensor([source], device=self.sums.device), loss.reshape(1))


class SourceSums:
    """Per source, over several model calls (a step's micro-batches, an evaluation): the summed
    token loss (fp64, on the device until :meth:`read`), and the label tokens and samples (counted
    on the host), each list indexed by source id."""

    def __init__(self, device: torch.device | str) -> None:
        self.loss = torch.zeros(0, dtype=torch.float64, device=device)
        self.label_tokens: list[int] = []
        self.samples: list[int] = []

    def _grow(self, size: int) -> None:
        if size > self.loss.numel():
            self.loss = torch.cat([self.loss, self.loss.new_zeros(size - self.loss.numel())])
        missing = size - len(self.samples)
        if missing > 0:
            self.label_tokens += [0] * missing
            self.samples += [0] * missing

    def add_split(self, split: SourceSplit) -> None:
        """A call's per-source sums (:attr:`SourceSplit.sums`)."""
        self._grow(split.sums.numel())
        self.loss[:split.sums.numel()] += split.sums

    def add_total(self, source: int, loss: torch.Tensor) -> None:
        """A call whose samples are all of ``source``: its summed loss (detached here)."""
        self._grow(source + 1)
        self.loss[source] += loss.detach().double()

    def count(self, source: int, label_tokens: int) -> None:
        """One sample of ``source`` with ``label_tokens`` label tokens."""
        self._grow(source + 1)
        self.samples[source] += 1
        self.label_tokens[source] += label_tokens

    def add_sums(self, other: SourceSums) -> None:
        """Adds ``other``'s sums and counts into these."""
        self._grow(len(other.samples))
        other._grow(len(other.samples))
        self.loss[:other.loss.numel()] += other.loss
        for source, (tokens, samples) in enumerate(zip(other.label_tokens, other.samples, strict=True)):
            self.label_tokens[source] += tokens
            self.samples[source] += samples

    def read(self) -> tuple[list[float], list[int], list[int]]:
        """``(loss, label_tokens, samples)`` per source, as long as the largest source seen + 1
        (one host sync)."""
        self._grow(len(self.samples))
        return self.loss.tolist(), list(self.label_tokens), list(self.samples)


def sample_source(sample: dict[str, Any]) -> int:
    """A processed sample's source id (0 for one without: a single-source dataset's)."""
    return int(sample.get("source", 0))
