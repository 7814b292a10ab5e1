"""Wire formats: the fixed-size int64 vectors ranks exchange, declared once by name.

A collective needs the same vector length on every rank, so each vector is a :class:`Layout`:
named scalars and named arrays of a fixed size (a rank fills what it has, zeros after). One
declaration encodes a rank's values and decodes the gathered ``[world, len]`` matrix, so no
position is written by hand in two places::

    layout = Layout(scalars=("num_bins", "num_ready"), arrays={"bin_costs": 4})
    vector = layout.encode(num_bins=2, num_ready=1, bin_costs=[7, 5])   # [2 1 7 5 0 0]
    fields = layout.decode(gathered)              # fields["num_bins"]: [world], fields["bin_costs"]: [world, 4]

Layouts may also be laid end to end (:meth:`Layout.then`): the round vector is the proposal
(:func:`proposal_layout`, filled from a :class:`Proposal`) followed by the telemetry report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PROPOSAL_SCALARS", "Layout", "Proposal", "proposal_layout"]


class Layout:
    """Named int64 scalars, then named fixed-size int64 arrays, in declaration order.

    Args:
        scalars: names of the single values, first in the vector.
        arrays: name -> number of slots, after the scalars; a rank's shorter array is zero-padded.
    """

    def __init__(self, scalars: Iterable[str] = (), arrays: Mapping[str, int] | None = None) -> None:
        self.scalars = tuple(scalars)
        self.arrays = dict(arrays or {})
        names = self.scalars + tuple(self.arrays)
        if len(set(names)) != len(names):
            raise ValueError(f"a wire layout names a field twice: {names}")
        if any(size < 0 for size in self.arrays.values()):
            raise ValueError(f"array sizes must be >= 0, got {self.arrays}")
        self._slices: dict[str, slice] = {}
        at = 0
        for name in self.scalars:
            self._slices[name] = slice(at, at + 1)
            at += 1
        for name, size in self.arrays.items():
            self._slices[name] = slice(at, at + size)
            at += size
        self.size = at

    def then(self, other: Layout) -> Layout:
        """This layout followed by ``other`` (their names must differ)."""
        return _Concat(self, other)

    def slice(self, name: str) -> slice:
        return self._slices[name]

    @property
    def names(self) -> tuple[str, ...]:
        """Every field, in vector order."""
        return tuple(self._slices)

    def encode(self, **values: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """One rank's vector; a field not given is zero. Raises ``ValueError`` for an unknown
        name or an array longer than its slots."""
        unknown = sorted(set(values) - set(self._slices))
        if unknown:
            raise ValueError(f"unknown wire field(s) {unknown}; this layout has {list(self._slices)}")
        out = np.zeros(self.size, dtype=np.int64)
        for name, value in values.items():
            where = self._slices[name]
            if name in self.arrays:
                value = np.asarray(value, dtype=np.int64).ravel()
                if len(value) > self.arrays[name]:
                    raise ValueError(f"wire field {name!r} holds {self.arrays[name]} values, got {len(value)}")
                out[where.start:where.start + len(value)] = value
            else:
                out[where.start] = int(value)
        return out

    def decode(self, gathered: np.ndarray) -> dict[str, np.ndarray]:
        """Fields of one vector ``[len]`` (scalars as ints, arrays ``[size]``) or of a gathered
        matrix ``[world, len]`` (scalars ``[world]``, arrays ``[world, size]``)."""
        if gathered.shape[-1] != self.size:
            raise ValueError(f"a wire vector of {gathered.shape[-1]} values does not fit this layout of {self.size}")
        fields: dict[str, np.ndarray] = {}
        for name, where in self._slices.items():
            column = gathered[..., where]
            fields[name] = column if name in self.arrays else column[..., 0]
        return fields


class _Concat(Layout):
    """Two layouts end to end, each keeping its own order (scalars of the second after the
    arrays of the first)."""

    def __init__(self, first: Layout, second: Layout) -> None:  # noqa: D107 - see the class
        names = set(first.names) & set(second.names)
        if names:
            raise ValueError(f"wire layouts laid end to end share names {sorted(names)}")
        self.scalars = first.scalars + second.scalars
        self.arrays = {**first.arrays, **second.arrays}
        self._slices = {name: first.slice(name) for name in first.names}
        for name in second.names:
            where = second.slice(name)
            self._slices[name] = slice(where.start + first.size, where.stop + first.size)
        self.size = first.size + second.size


# The proposal's scalars, first in its vector (see proposal_layout for the arrays after them).
PROPOSAL_SCALARS = ("is_fatal", "is_exhausted", "num_bins", "num_ready", "window_samples", "window_cost",
                    "num_pending", "observed_cost", "observed_cost_sq", "observed_samples", "is_first_pass_open",
                    "num_skipped", "num_dropped")


PER_SAMPLE = ("sample_labels", "sample_tokens", "sample_costs")  # quota mode only


def proposal_layout(max_bins: int, max_samples: int, *, per_sample_costs: bool) -> Layout:
    """The proposal vector: :data:`PROPOSAL_SCALARS`, then per ranked bin its cost, samples, tokens
    and label tokens (``max_bins`` slots each), then in quota mode (``per_sample_costs``: the round
    that reaches the quota may cut a bin) per sample, bin after bin, its label tokens, tokens and
    cost step (``max_samples`` slots each)."""
    arrays = dict.fromkeys(("bin_costs", "bin_samples", "bin_tokens", "bin_labels"), max_bins)
    if per_sample_costs:
        arrays.update(dict.fromkeys(PER_SAMPLE, max_samples))
    return Layout(scalars=PROPOSAL_SCALARS, arrays=arrays)


@dataclass
class Proposal:
    """What one rank sends: its figures and its ranked bins.

    The fields are the names of :func:`proposal_layout` (``num_bins`` is ``len(bin_costs)``).
    ``sample_labels``, ``sample_tokens`` and ``sample_costs`` (quota mode only, ``None`` otherwise)
    let every rank price a cut bin exactly: the first k cost steps of a bin sum to the cost of its
    first k samples as one bin.
    """

    is_fatal: bool  # this rank must stop (a bad sample under strict, an over-cap error): all stop
    is_exhausted: bool
    num_ready: int
    window_samples: int
    window_cost: int
    num_pending: int
    observed_cost: int
    observed_cost_sq: int
    observed_samples: int  # samples admitted over the whole run
    is_first_pass_open: bool  # indices of the run's first pass over the data still to be fetched
    num_skipped: int  # over the whole run: records the data layer skipped
    num_dropped: int  # ... and samples dropped over the cap
    bin_costs: list[int]
    bin_samples: list[int]
    bin_tokens: list[int]
    bin_labels: list[int]
    sample_labels: list[int] | None = None
    sample_tokens: list[int] | None = None
    sample_costs: list[int] | None = None

    def layout(self, max_bins: int, max_samples: int) -> Layout:
        """This proposal's :func:`proposal_layout` (the same on every rank: the mode is checked)."""
        return proposal_layout(max_bins, max_samples, per_sample_costs=self.sample_labels is not None)

    def values(self) -> dict[str, int | list[int]]:
        """The layout's fields by name, for :meth:`odb.batching.wire.Layout.encode`."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values = {name: value for name, value in values.items() if value is not None}
        per_sample = [values[name] for name in PER_SAMPLE if name in values]
        assert len(per_sample) in (0, len(PER_SAMPLE)) and len({len(v) for v in per_sample}) <= 1, \
            "quota mode sends every per-sample field, one value per sample; join mode none"
        return {**values, "num_bins": len(self.bin_costs)}
