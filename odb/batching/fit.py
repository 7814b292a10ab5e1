"""Cost coefficients fitted from the run's own micro-batch times (``cost_model: "fit"``).

The cost model prices a sample as ``tokens + attn_coef * tokens**2 + patch_coef * patches``, in
units of one token's time (:class:`odb.batching.cost.CostModel`; a preference pair's attention
term is its two sequences' apart, ``attn_coef * (chosen**2 + rejected**2)``). Tokens alone
misjudge a real step: at equal tokens, one long sample costs more than many short ones (attention
grows with each sequence's squared length), and a vision tower's patches cost apart from the text. A sample
longer than ``max_tokens`` (over_cap ``"sequence_parallel"``) is trained by a group of ``g``
ranks together, each holding ``tokens / g`` of it, and an all-to-all exchange adds time in
proportion to those tokens: such a sample costs each rank of its group
``(tokens + attn_coef * tokens**2 + a2a_coef * tokens) / g``. With ``cost_model: "fit"`` the
coefficients come from the run itself. Every rank times each real micro-batch's forward pass
(not the backward, which ends waiting for the other ranks in the gradient reduction:
:class:`odb.training.step.clock.ForwardClock`), and a least-squares fit over the recent micro-batches
of all ranks solves

    time_us ~ d + a * tokens + b * sum(L**2) + c * patches + e * a2a     a > 0,  b, c, e >= 0

where ``L`` runs over the micro-batch's sequences, each attending only to itself (a sample's one,
or a preference pair's two, chosen and rejected apart; a padded micro-batch: its rows, a sequence
each, each as long as the longest) and ``a2a`` is 0 but for a micro-batch that is a rank's slice
of a sample shared by a group of ``g``: its tokens are the slice's, its ``sum(L**2)`` is
``L**2 / g`` of the whole sample, its patches 0 and its ``a2a`` the slice's tokens. Then
``attn_coef = b / a``, ``patch_coef = c / a`` and ``a2a_coef = e / a``; ``d``, what any
micro-batch costs whatever it holds, does not enter the balance (every rank runs the same number
of micro-batches). Full micro-batches all hold about ``max_tokens`` tokens, so ``d`` and ``a`` can
only be told apart where the tokens vary (:data:`TOKEN_SPREAD`); else the fit has no ``d``. A
slice's ``a2a`` equals its tokens, so ``e`` and ``a`` can only be told apart where the window
holds slices and other micro-batches both; else the fit leaves ``e`` out: with slices alone their
all-to-all is in the token term (``a2a_coef`` 0), with no slice the all-to-all coefficient in
effect stays (the configured ``a2a_coef`` until a fit sees both). A fit is held to
:data:`MAX_ATTENTION`, :data:`MAX_PATCH` and :data:`MAX_A2A`, so that a noisy one cannot price a
sample absurdly.

Agreement, with no collective of its own: a rank's new observations ride on its next round's
vector (:func:`fit_layout`); after the gather every rank adds every rank's, in rank order, to the
same window of the last :data:`WINDOW` (each rank sends its newest, at most ``WINDOW // world`` a
round, so that many ranks do not push each other out), and rank 0 solves. Its coefficients ride
on the round after as the bits of three float64s, and every rank takes rank 0's: the same floats
everywhere, whatever another machine's LAPACK would have computed from the same window. The
batcher prices its window with them after that round's decision, so they plan from its next
proposal on (:meth:`odb.batching.batcher.OnlineBatcher.observe` feeds the times).

The timings make the plans depend on the machine: two runs of the same seed plan alike only with
``cost_model: "manual"``. A resume continues with the coefficients, window and unsent
observations of its checkpoint (:meth:`CostFit.state_dict`); its plans match the uninterrupted
run's only as far as the times do (its first step's are left out, as every process's are). A
checkpoint written before the all-to-all term existed loads with the run's configured
``a2a_coef`` and its observations' ``a2a`` 0.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from odb.batching.plan import MicroBatch
from odb.batching.wire import Layout

__all__ = ["FIELDS", "WINDOW", "CostFit", "Fitted", "Observation", "features", "fit_coefficients", "fit_layout"]

WINDOW = 256
"""Micro-batches (of all ranks) the fit looks at: the most recent."""
MIN_OBSERVATIONS = 16
"""The fit waits for this many micro-batches in its window."""
SEND = 32
"""A rank's observations per round, at most (the most recent: the window keeps no more anyway)."""
FIELDS = ("tokens", "area", "patches", "time_us", "a2a")
TOKEN_SPREAD = 0.1
"""The fit has a per-micro-batch term ``d`` only where the tokens of its micro-batches spread this
much (standard deviation over mean)."""
MAX_ATTENTION = 64.0
"""The attention term of the longest sample seen is at most this many times its token term."""
MAX_PATCH = 64.0
"""A vision patch costs at most this many tokens."""
MAX_A2A = 64.0
"""The all-to-all adds at most this many tokens' time per token of a rank's slice of a long sample."""


class Observation(NamedTuple):
    """One real micro-batch: its tokens (padding included), the sum of its samples' squared
    lengths, its vision patches, its forward time in microseconds, and the tokens that are a rank's
    slice of a sample shared by a group of ranks (0 for an ordinary micro-batch; a slice's
    micro-batch: tokens and ``a2a`` the slice's, area ``L**2 / g`` of the whole sample, patches 0)."""

    tokens: int
    area: int
    patches: int
    time_us: int
    a2a: int = 0


class Fitted(NamedTuple):
    """A fit: the cost model's coefficients, how well the model explains the times (R^2) and how
    many micro-batches it saw (``a2a_coef`` last: a fit of a checkpoint written before it has None)."""

    attn_coef: float
    patch_coef: float
    r2: float
    observations: int
    a2a_coef: float | None = None
    """None: the window did not tell it (no slice, or only slices); the one in effect stays."""


def fit_layout(send: int = SEND) -> Layout:
    """The fit's part of a round vector: ``send`` observations per field, how many are real, and
    the fit rank 0 last solved (its coefficients as float64 bits, its R^2 in millionths and its
    number of micro-batches; ``fit_ready`` 0: none yet)."""
    return Layout(scalars=("fit_count", "fit_ready", "fit_attn_bits", "fit_patch_bits", "fit_a2a_bits",
                           "fit_r2_micro", "fit_n"),
                  arrays={f"fit_{name}": send for name in FIELDS},
                  lengths={f"fit_{name}": "fit_count" for name in FIELDS})


def send_for(world_size: int) -> int:
    """The observations a rank sends per round: what the window takes of each rank's (its newest
    ``WINDOW // world``, at least one; never more than :data:`SEND`)."""
    return min(SEND, max(1, WINDOW // max(1, world_size)))


def _bits(value: float) -> int:
    return int(np.array(value, dtype=np.float64).view(np.int64))


def _float(bits: int) -> float:
    return float(np.array(bits, dtype=np.int64).view(np.float64))


def _significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits: a fit that moves by noise leaves costs alone."""
    return float(f"{value:.{digits - 1}e}")


def fit_coefficients(observations: list[Observation]) -> Fitted | None:
    """The least-squares fit of the module docstring, or None when the times do not determine
    it: fewer than :data:`MIN_OBSERVATIONS` micro-batches, or no fit with ``a > 0``.

    ``b``, ``c`` and ``e`` are held at 0 where the free fit makes them negative (each subset of the
    attention, patch and all-to-all terms is tried; the feasible one with the least squared error
    wins), and a term whose feature does not vary is left out (0). The all-to-all's is left out where
    its share of the tokens does not vary: with only slices it is 0 (their all-to-all is in the
    token term then); with no slice, None (the times say nothing of it: the one in effect stays)."""
    if len(observations) < MIN_OBSERVATIONS:
        return None
    data = np.array(observations, dtype=np.float64)
    x, y = data[:, [0, 1, 2, 4]], data[:, 3]  # tokens, area, patches, a2a; the time
    scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns of order 1: the solve is well conditioned
    columns = x / scale
    varying = [j for j in (1, 2) if np.ptp(columns[:, j]) > 1e-9]
    share = x[:, 3] / np.maximum(x[:, 0], 1.0)  # (a slice's a2a is its tokens: slices alone cannot tell e from a)
    if np.ptp(columns[:, 3]) > 1e-9 and np.ptp(share) > 1e-9:
        varying.append(3)
    intercept = [np.ones(len(y))] if x[:, 0].std() > TOKEN_SPREAD * x[:, 0].mean() else []
    best: tuple[float, np.ndarray] | None = None
    for size in range(len(varying), -1, -1):
        for extra in itertools.combinations(varying, size):
            used = [0, *extra]
            design = np.column_stack([*intercept, columns[:, used]])
            solution, *_ = np.linalg.lstsq(design, y, rcond=None)
            coef = np.zeros(4)
            coef[used] = solution[len(intercept):] / scale[used]
            if coef[0] <= 0 or (coef[1:] < 0).any():
                continue
            error = float(((design @ solution - y) ** 2).sum())
            if best is None or error < best[0] - 1e-12 * max(1.0, error):
                best = (error, coef)
    if best is None:
        return None
    error, (a, b, c, e) = best
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - error / total if total > 0 else 1.0
    # (sum L^2 / sum L <= the longest L; a slice's L^2 / g over L / g: its whole sample's L)
    longest = float((x[:, 1] / np.maximum(x[:, 0], 1.0)).max())
    attn = min(b / a, MAX_ATTENTION / max(longest, 1.0))
    a2a = _significant(min(e / a, MAX_A2A)) if 3 in varying else 0.0 if x[:, 3].any() else None
    return Fitted(_significant(attn), _significant(min(c / a, MAX_PATCH)), round(r2, 4), len(observations), a2a)


class CostFit:
    """One rank's side of the fit (the module docstring): its observations not yet sent, the
    window every rank holds alike, and the coefficients in effect.

    Args:
        rank: this rank (rank 0 solves).
        attn_coef, patch_coef, a2a_coef: the coefficients until the first fit (the config's).
    """

    def __init__(self, *, rank: int, attn_coef: float, patch_coef: float, a2a_coef: float = 0.0,
                 world_size: int = 1) -> None:
        self.rank = rank
        self.unsent: deque[Observation] = deque(maxlen=SEND)
        self.window: deque[Observation] = deque(maxlen=WINDOW)
        self.coefficients = (attn_coef, patch_coef, a2a_coef)  # in effect: the cost model's
        self.fitted: Fitted | None = None  # the fit in effect (None: the config's coefficients)
        self.solved: Fitted | None = None  # rank 0: its latest fit, sent at the next round
        self.send = send_for(world_size)  # (the window would keep no more of a rank's)
        self.layout = fit_layout(self.send)

    def observe(self, observation: Observation) -> None:
        self.unsent.append(observation)

    def fields(self) -> dict[str, Any]:
        """This rank's part of the next round's vector: its newest observations, as many as the
        window takes of a rank's (:func:`send_for`); the older ones are dropped with them."""
        sent = list(self.unsent)[-self.send:]
        self.unsent.clear()
        columns = {f"fit_{name}": [getattr(o, name) for o in sent] for name in FIELDS}
        solved = self.solved if self.rank == 0 else None
        return {"fit_count": len(sent), "fit_ready": int(solved is not None),
                "fit_attn_bits": _bits(solved.attn_coef) if solved else 0,
                "fit_patch_bits": _bits(solved.patch_coef) if solved else 0,
                "fit_a2a_bits": _bits(-1.0 if solved.a2a_coef is None else solved.a2a_coef) if solved else 0,
                "fit_r2_micro": round(solved.r2 * 1e6) if solved else 0, "fit_n": solved.observations if solved else 0,
                **columns}

    def merge(self, gathered: Mapping[str, np.ndarray]) -> bool:
        """After a round's gather (``gathered``: the fit's fields ``[world, ...]``): rank 0's
        coefficients take effect, every rank's observations join the window, and rank 0 solves the
        fit it sends next. Whether the coefficients in effect changed."""
        changed = False
        if gathered["fit_ready"][0]:
            a2a = _float(gathered["fit_a2a_bits"][0])  # (-1: not told by the window)
            fitted = Fitted(_float(gathered["fit_attn_bits"][0]), _float(gathered["fit_patch_bits"][0]),
                            int(gathered["fit_r2_micro"][0]) / 1e6, int(gathered["fit_n"][0]), None if a2a < 0 else a2a)
            coefficients = (fitted.attn_coef, fitted.patch_coef,
                            self.coefficients[2] if fitted.a2a_coef is None else fitted.a2a_coef)
            changed = coefficients != self.coefficients
            self.coefficients, self.fitted = coefficients, fitted
        world = len(gathered["fit_count"])
        share = max(1, WINDOW // world)  # each rank's newest: many ranks do not push each other out
        for rank in range(world):
            count = int(gathered["fit_count"][rank])
            rows = zip(*(gathered[f"fit_{name}"][rank, max(0, count - share):count].tolist() for name in FIELDS),
                       strict=True)
            self.window.extend(Observation(*row) for row in rows)
        if self.rank == 0 and gathered["fit_count"].any():  # (no new times: the same window, the same fit)
            self.solved = fit_coefficients(list(self.window)) or self.solved
        return changed

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the coefficients in effect, rank 0's pending fit, the window, the unsent."""
        return {"coefficients": list(self.coefficients), "fitted": list(self.fitted) if self.fitted else None,
                "solved": list(self.solved) if self.solved else None,
                "window": [list(o) for o in self.window], "unsent": [list(o) for o in self.unsent]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A state of :meth:`state_dict`, or of the version before the all-to-all term (two
        coefficients, fits of four values, observations of four): ``a2a_coef`` as constructed (the
        run's setting), ``a2a`` 0."""
        self.coefficients = (*state["coefficients"], self.coefficients[2])[:3]
        self.fitted = Fitted(*state["fitted"]) if state.get("fitted") else None
        self.solved = Fitted(*state["solved"]) if state.get("solved") else None
        self.window = deque((Observation(*o) for o in state["window"]), maxlen=WINDOW)
        self.unsent = deque((Observation(*o) for o in state["unsent"]), maxlen=SEND)


def features(micro: MicroBatch) -> tuple[int, int, int, int]:
    """What the cost fit sees of a micro-batch: tokens (padding included), the sum of its sequences'
    squared lengths (a pair's two apart; a padded one: its rows, each as long as the longest
    sequence), vision patches, and the
    tokens that go through an all-to-all. A rank's slice of a shared sample (``T`` tokens over
    ``d`` ranks): ``T / d`` tokens, ``T**2 / d`` (its ``1 / d`` of the heads over the whole
    sample), and its ``T / d`` tokens through the all-to-all."""
    if micro.shared is not None:
        tokens, degree = micro.shared.tokens, micro.shared.degree
        slice_tokens = -(-tokens // degree)
        return slice_tokens, tokens * tokens // degree, 0, slice_tokens
    if micro.padded:
        longest = max(s.longest for s in micro.samples)
        area = micro.rows * longest * longest
    else:
        area = sum(s.area for s in micro.samples)
    return micro.materialized, area, sum(s.patches for s in micro.samples), 0
