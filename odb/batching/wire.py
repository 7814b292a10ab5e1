"""Wire formats: the int64 vectors ranks exchange, declared once by name.

Every rank must read every rank's vector alike, so each vector is a :class:`Layout`:
named scalars and named arrays of a fixed size (a rank fills what it has, zeros after). One
declaration encodes a rank's values and decodes the gathered ``[world, len]`` matrix, so no
position is written by hand in two places::

    layout = Layout(scalars=("num_bins", "num_ready"), arrays={"bin_costs": 4})
    vector = layout.encode(num_bins=2, num_ready=1, bin_costs=[7, 5])   # [2 1 7 5 0 0]
    fields = layout.decode(gathered)              # fields["num_bins"]: [world], fields["bin_costs"]: [world, 4]

Layouts may also be laid end to end (:meth:`Layout.then`): the round vector is the proposal
(:func:`proposal_layout`, filled from a :class:`Proposal`) followed by the telemetry report.

On the wire a vector travels as a *row* (:meth:`Layout.pack`): an array whose used length a scalar
of the same vector gives (``lengths``: ``bin_costs`` holds ``num_bins`` values) sends only those,
so a rank sends what it holds rather than the room a layout keeps for the worst case. Rows differ
in length across ranks; :meth:`Layout.unpack` reads every rank's (all of them end to end) back into
fields, each array as wide as the widest rank's, zeros after a rank's own values, as
:meth:`Layout.decode` gives them but for the room no rank used::

    layout = Layout(scalars=("num_bins",), arrays={"bin_costs": 4}, lengths={"bin_costs": "num_bins"})
    layout.pack(layout.encode(num_bins=2, bin_costs=[7, 5]))    # [2 7 5]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PROPOSAL_SCALARS", "Layout", "Proposal", "proposal_layout", "row_starts", "segments"]


def row_starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of rows of ``lengths`` laid end to end begins."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def segments(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[len(starts), max(lengths)]``: row r holds ``values[starts[r]:starts[r] + lengths[r]]``,
    then zeros (one gather for every row)."""
    width = int(lengths.max()) if len(lengths) else 0
    columns = np.arange(width)[None, :]
    inside = columns < lengths[:, None]
    if not values.size:
        return np.zeros((len(lengths), width), dtype=np.int64)
    return np.where(inside, values[np.where(inside, starts[:, None] + columns, 0)], 0)


class Layout:
    """Named int64 scalars, then named fixed-size int64 arrays, in declaration order.

    Args:
        scalars: names of the single values, first in the vector.
        arrays: name -> number of slots, after the scalars; a rank's shorter array is zero-padded.
        lengths: array name -> the scalar that holds how many of its slots are used (on the wire,
            :meth:`pack`, only those travel; the values after them must be zeros).
    """

    def __init__(self, scalars: Iterable[str] = (), arrays: Mapping[str, int] | None = None,
                 lengths: Mapping[str, str] | None = None) -> None:
        self.scalars = tuple(scalars)
        self.arrays = dict(arrays or {})
        self.lengths = dict(lengths or {})
        names = self.scalars + tuple(self.arrays)
        if len(set(names)) != len(names):
            raise ValueError(f"a wire layout names a field twice: {names}")
        if any(size < 0 for size in self.arrays.values()):
            raise ValueError(f"array sizes must be >= 0, got {self.arrays}")
        if not all(a in self.arrays and s in self.scalars for a, s in self.lengths.items()):
            raise ValueError(f"lengths must map arrays to scalars of the layout, got {self.lengths}")
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

    def pack(self, vector: np.ndarray) -> np.ndarray:
        """One rank's vector (:meth:`encode`) as it travels: the scalars, then each array, an array
        of ``lengths`` cut to its used slots (raises ``ValueError`` if a value after them is not 0)."""
        scalars = np.array([vector[self._slices[name].start] for name in self.scalars], dtype=np.int64)
        parts = [scalars]
        for name, size in self.arrays.items():
            start, used = self._slices[name].start, self._used(name, vector)
            if vector[start + used:start + size].any():
                raise ValueError(f"wire field {name!r}: values after its {used} used slots "
                                 f"({self.lengths[name]}) would not travel")
            parts.append(vector[start:start + used])
        return np.concatenate(parts)

    def _used(self, name: str, vector: np.ndarray) -> int:
        size = self.arrays[name]
        if name not in self.lengths:
            return size
        return min(size, max(0, int(vector[self._slices[self.lengths[name]].start])))

    def unpack(self, rows: np.ndarray, row_lengths: np.ndarray) -> dict[str, np.ndarray]:
        """Every rank's :meth:`pack` row, end to end in rank order (``rows``, ``row_lengths[r]``
        values of rank r) -> the fields of :meth:`decode` (scalars ``[world]``, arrays
        ``[world, width]``), each array as wide as the most slots any rank used. Raises
        ``ValueError`` where a row's length is not what its own scalars say (another layout)."""
        row_lengths = np.asarray(row_lengths, dtype=np.int64)
        return self._unpack(rows, row_starts(row_lengths), row_lengths, exact=True)

    def unpack_matrix(self, matrix: np.ndarray) -> dict[str, np.ndarray]:
        """:meth:`unpack` of rows each zero-padded to one length (``[world, width]``)."""
        world, width = matrix.shape
        return self._unpack(matrix.reshape(-1), np.arange(world, dtype=np.int64) * width,
                            np.full(world, width, dtype=np.int64), exact=False)

    def _unpack(self, rows: np.ndarray, starts: np.ndarray, row_lengths: np.ndarray, *, exact: bool):
        world, count = len(row_lengths), len(self.scalars)
        if world and (row_lengths < count).any():
            raise ValueError(f"a wire row of {int(row_lengths.min())} values holds fewer than this layout's "
                             f"{count} scalars: the ranks run different odb versions or settings")
        scalars = rows[starts[:, None] + np.arange(count)[None, :]] if world else np.zeros((0, count), np.int64)
        fields = {name: scalars[:, i] for i, name in enumerate(self.scalars)}
        at, ends = starts + count, starts + row_lengths  # where each rank's next array begins, its row ends
        overrun = np.zeros(world, dtype=bool)  # a row shorter than its own scalars say
        for name, size in self.arrays.items():
            if name in self.lengths:
                used = np.clip(fields[self.lengths[name]], 0, size)
            else:
                used = np.full(world, size, dtype=np.int64)
            overrun |= used > ends - at
            used = np.minimum(used, np.maximum(ends - at, 0))
            fields[name] = segments(rows, at, used)
            at = at + used
        wrong = overrun | (at != ends) if exact else overrun
        if world and wrong.any():
            bad = np.flatnonzero(wrong).tolist()
            raise ValueError(f"the wire rows of rank(s) {bad} do not fit this layout: "
                             "the ranks run different odb versions or settings")
        return {name: fields[name] for name in self.names}


class _Concat(Layout):
    """Two layouts end to end, each keeping its own order (scalars of the second after the
    arrays of the first)."""

    def __init__(self, first: Layout, second: Layout) -> None:  # noqa: D107 - see the class
        names = set(first.names) & set(second.names)
        if names:
            raise ValueError(f"wire layouts laid end to end share names {sorted(names)}")
        self.scalars = first.scalars + second.scalars
        self.arrays = {**first.arrays, **second.arrays}
        self.lengths = {**first.lengths, **second.lengths}
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
    per_bin = ("bin_costs", "bin_samples", "bin_tokens", "bin_labels")
    arrays, lengths, scalars = dict.fromkeys(per_bin, max_bins), dict.fromkeys(per_bin, "num_bins"), PROPOSAL_SCALARS
    if per_sample_costs:
        scalars += ("num_binned",)  # samples in the bins
        arrays.update(dict.fromkeys(PER_SAMPLE, max_samples))
        lengths.update(dict.fromkeys(PER_SAMPLE, "num_binned"))
    return Layout(scalars=scalars, arrays=arrays, lengths=lengths)


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
        binned = {"num_binned": len(self.sample_labels)} if self.sample_labels is not None else {}
        return {**values, "num_bins": len(self.bin_costs), **binned}
