"""The cost fit (``cost_model: "fit"``, odb/batching/fit.py): the least squares against the
coefficients the times were made with (the all-to-all term of a rank's slice of a long sample
among them), and the fit inside the batcher over simulated ranks whose micro-batch times follow a
known law: every rank takes the same coefficients, the invariants hold, and a state carries the
fit (a state of the release before the all-to-all term too)."""

from collections import Counter

import numpy as np
import pytest

from conftest import check_aligned, check_exact_once, roundtrip
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.fit import (
    MAX_A2A,
    MAX_ATTENTION,
    MAX_PATCH,
    MIN_OBSERVATIONS,
    CostFit,
    Observation,
    features,
    fit_coefficients,
    fit_layout,
)
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks, simulate

# a step's law: 300 us a micro-batch, 2 us a token, 0.004 us per squared token, 0.5 us a patch, and
# 1.5 us per token of a rank's slice of a long sample (the all-to-all)
D, A, B, C, E = 300.0, 2.0, 0.004, 0.5, 1.5


def law(tokens: int, area: int, patches: int, a2a: int = 0, *, e: float = E) -> float:
    return D + A * tokens + B * area + C * patches + e * a2a


def observations(count: int, seed: int, *, noise: float = 0.0, patches: bool = True) -> list[Observation]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = rng.integers(1, 2000, size=rng.integers(1, 6))
        p = int(rng.integers(0, 40000)) if patches else 0
        tokens, area = int(lengths.sum()), int((lengths ** 2).sum())
        out.append(Observation(tokens, area, p, round(law(tokens, area, p) * (1 + noise * rng.standard_normal()))))
    return out


def slices(count: int, seed: int, *, noise: float = 0.0, e: float = E) -> list[Observation]:
    """Micro-batches that are a rank's slice of a long sample (``L`` of 2000 to ``2000 * g`` tokens)
    shared by a group of ``g`` ranks (2, 4 or 8), as the batcher reports them: the slice's tokens,
    ``L**2 / g``, no patches, the slice's tokens through the all-to-all (``e`` us each)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        g = int(rng.choice((2, 4, 8)))
        length = int(rng.integers(2000, 2000 * g))
        tokens, area = -(-length // g), length * length // g
        time = law(tokens, area, 0, tokens, e=e) * (1 + noise * rng.standard_normal())
        out.append(Observation(tokens, area, 0, round(time), tokens))
    return out


def free_fit(rows: list[Observation], names: tuple[str, ...]) -> np.ndarray:
    """The unconstrained least squares of the times on a per-micro-batch term and the features
    ``names``, straight from numpy: the coefficient of each feature."""
    design = np.array([[1.0, *(getattr(o, name) for name in names)] for o in rows])
    solution, *_ = np.linalg.lstsq(design, np.array([o.time_us for o in rows], dtype=float), rcond=None)
    return solution[1:]


def test_the_fit_finds_the_coefficients_the_times_were_made_with():
    fitted = fit_coefficients(observations(200, seed=1))
    assert fitted.attn_coef == pytest.approx(B / A, rel=1e-3)
    assert fitted.patch_coef == pytest.approx(C / A, rel=1e-3)
    assert fitted.r2 > 0.9999 and fitted.observations == 200
    noisy = fit_coefficients(observations(256, seed=2, noise=0.05))
    assert noisy.attn_coef == pytest.approx(B / A, rel=0.15) and noisy.patch_coef == pytest.approx(C / A, rel=0.15)


def test_a_term_the_times_do_not_show_is_zero_and_too_few_times_fit_nothing():
    # text only: no patch varies, so no patch term; times with no attention term: b clamped at 0
    text = fit_coefficients(observations(100, seed=3, patches=False))
    assert text.patch_coef == 0 and text.attn_coef == pytest.approx(B / A, rel=1e-3)
    flat = [o._replace(time_us=round(D + A * o.tokens - 1e-4 * o.area)) for o in observations(100, seed=4)]
    assert fit_coefficients(flat).attn_coef == 0.0
    assert fit_coefficients(observations(MIN_OBSERVATIONS - 1, seed=5)) is None
    # times that fall as tokens grow: no fit with a > 0
    assert fit_coefficients([o._replace(time_us=10**6 - o.tokens) for o in observations(50, seed=6)]) is None


def micro_seconds(rank: int, step) -> list[float]:
    """Times by the law (patches ignored: text), each rank a little slower than the one before."""
    return [law(*features(m)) * (1 + 0.01 * rank) / 1e6 if not m.is_dummy else 1e-4 for m in step.micro_batches]


def test_simulated_ranks_agree_on_the_fitted_coefficients_and_keep_the_invariants():
    rng = np.random.default_rng(0)
    lengths = [(int(t), 0) for t in rng.integers(20, 1500, size=600)]
    config = OdbConfig(max_tokens=2048, window=32, gas=2, lookahead=8)
    result = simulate(config, lengths, 4, num_epochs=2, train=micro_seconds)
    check_aligned(result.steps)
    check_exact_once(result.steps, Counter(e * 600 + i for e in range(2) for i in range(600)))
    coefficients = {b.cost_model.attn_coef for b in result.batchers}
    assert len(coefficients) == 1  # the same float on every rank (rank 0's, sent as bits)
    fitted = result.batchers[0].cost_fit
    # (full bins hold about max_tokens tokens: no per-micro-batch term, whose D then counts as tokens' time)
    assert fitted is not None and B / (A + D / 2048) * 0.97 <= fitted.attn_coef <= B / A * 1.03
    assert all(b.cost_fit == fitted for b in result.batchers)
    # the window is priced with what is in effect: a sample's cost is the model's at those coefficients
    late = result.steps[0][-3].micro_batches[0].samples[0]
    assert late.cost == round(late.tokens + fitted.attn_coef * late.tokens ** 2)


def test_manual_and_fit_without_times_plan_alike():
    """Without times the fit never moves: the plans are those of the manual cost model."""
    rng = np.random.default_rng(1)
    lengths = [(int(t), 0) for t in rng.integers(20, 900, size=300)]
    plans = [simulate(OdbConfig(max_tokens=1024, window=24, gas=1, cost_model=mode), lengths, 3).steps
             for mode in ("fit", "manual")]
    assert plans[0] == plans[1]


def timed(batcher: OnlineBatcher, rank: int, stop: int | None = None) -> list:
    """The steps ``batcher`` plans (at most ``stop``), each one's micro-batches timed by
    :func:`micro_seconds` for ``rank`` and observed."""
    steps = []
    for step in batcher:
        steps.append(step)
        batcher.observe(step, micro_seconds(rank, step))
        if len(steps) == stop:
            break
    return steps


def test_a_state_carries_the_fit_and_a_resume_plans_as_the_uninterrupted_run():
    rng = np.random.default_rng(2)
    lengths = [(int(t), 0) for t in rng.integers(20, 1500, size=400)]
    config = OdbConfig(max_tokens=2048, window=24, gas=1, lookahead=8)
    whole = simulate(config, lengths, 2, train=micro_seconds)
    cut = 40
    states: list = [None, None]

    def first_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))
        steps = timed(batcher, comm.rank, stop=cut)
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    def second_part(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))
        batcher.load_state_dict(states[comm.rank])
        batcher.is_warm = True  # (the uninterrupted run skipped only its very first step's times)
        return timed(batcher, comm.rank), batcher.cost_model.attn_coef

    first = run_ranks(2, first_part)
    assert states[0]["fit"]["fitted"] is not None  # the fit was in effect when the state was taken
    second = run_ranks(2, second_part)
    for rank in range(2):
        assert first[rank] + second[rank][0] == whole.steps[rank]
    assert second[0][1] == whole.batchers[0].cost_model.attn_coef

    # on another world size: every new rank takes the fit, without what a rank had not sent yet
    dealt = redeal_states(states, 3)
    assert all(s["fit"]["window"] == states[0]["fit"]["window"] and s["fit"]["unsent"] == [] for s in dealt)


def test_a_fit_cannot_price_a_sample_absurdly():
    """Full micro-batches (8192 tokens each: no per-micro-batch term) whose times barely grow with
    tokens: the free fit would make the attention term of a 4096-token sample hundreds of
    thousands of times its tokens' time; it stays within MAX_ATTENTION times, and a patch within
    MAX_PATCH tokens."""
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(64):
        lengths = rng.integers(1, 4096, size=2)
        lengths = np.append(lengths, 8192 - lengths.sum())
        area, patches = int((lengths ** 2).sum()), int(rng.integers(0, 10))
        rows.append(Observation(8192, area, patches, round(1 + 0.01 * area + 1000 * patches)))
    fitted = fit_coefficients(rows)
    longest = max(o.area / o.tokens for o in rows)
    assert fitted.attn_coef * longest == pytest.approx(MAX_ATTENTION, rel=1e-3) and fitted.patch_coef == MAX_PATCH


def test_a_resume_may_switch_the_cost_model_and_prices_its_window_again():
    """A state written before the fit existed (no cost_model, no fit) loads under the default fit;
    a state of a fitting run loads under cost_model manual, its window priced by tokens again."""
    lengths = [(int(t), 0) for t in np.random.default_rng(3).integers(20, 1500, size=400)]
    config = OdbConfig(max_tokens=2048, window=24, gas=1, lookahead=8)
    states: list = [None, None]

    def fitting(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))
        for count, step in enumerate(batcher, 1):
            batcher.observe(step, micro_seconds(comm.rank, step))
            if count == 40:
                break
        states[comm.rank] = roundtrip(batcher.state_dict())

    run_ranks(2, fitting)
    assert states[0]["fit"]["fitted"] is not None

    def window(config, state):
        def load(comm):
            batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))
            batcher.load_state_dict(state[comm.rank])
            held = [s for b in batcher.packer.bins for s in b.samples] + list(batcher.packer.unpacked)
            return [(s.tokens, s.cost) for s in held]
        return run_ranks(2, load)

    priced = window(OdbConfig(max_tokens=2048, window=24, gas=1, lookahead=8, cost_model="manual"), states)
    assert all(held and all(cost == tokens for tokens, cost in held) for held in priced)
    old = [{**s, "config": {k: v for k, v in s["config"].items() if k != "cost_model"}} for s in states]
    for state in old:
        del state["fit"]
    assert all(held for held in window(config, old))


def test_the_fit_finds_the_all_to_all_term_of_slices_among_ordinary_micro_batches():
    """Exact times (whole microseconds): every coefficient to 4 significant digits. Times with 1%
    noise: within 20% (the all-to-all is a small part of a slice's time, whose attention term
    dominates), the others within 15%."""
    fitted = fit_coefficients(observations(160, seed=11) + slices(96, seed=12))
    assert fitted.a2a_coef == pytest.approx(E / A, rel=1e-3)
    assert fitted.attn_coef == pytest.approx(B / A, rel=1e-3) and fitted.patch_coef == pytest.approx(C / A, rel=1e-3)
    assert fitted.r2 > 0.9999 and fitted.observations == 256
    noisy = fit_coefficients(observations(160, seed=13, noise=0.01) + slices(96, seed=14, noise=0.01))
    assert noisy.a2a_coef == pytest.approx(E / A, rel=0.2)
    assert noisy.attn_coef == pytest.approx(B / A, rel=0.15) and noisy.patch_coef == pytest.approx(C / A, rel=0.15)


def test_without_slices_or_with_only_slices_the_fit_has_no_all_to_all_term():
    """No slice: the fit is the one without the term (here the free least squares, every term
    positive). Only slices: a slice's all-to-all tokens are its tokens, so the two cannot be told
    apart: no term, the all-to-all counted as tokens' time (attention B / (A + E) a token's)."""
    rows = observations(200, seed=15, noise=0.05)
    a, b, c = free_fit(rows, ("tokens", "area", "patches"))
    assert a > 0 and b > 0 and c > 0  # (the constrained fit is the free one)
    fitted = fit_coefficients(rows)
    assert fitted.a2a_coef is None  # (not told: the configured one stays in effect, CostFit.merge)
    assert fitted.attn_coef == pytest.approx(b / a, rel=1e-3) and fitted.patch_coef == pytest.approx(c / a, rel=1e-3)
    alone = fit_coefficients(slices(64, seed=16))
    assert alone.a2a_coef == 0.0 and alone.patch_coef == 0.0  # (their all-to-all: in the token term)
    assert alone.attn_coef == pytest.approx(B / (A + E), rel=1e-3) and alone.r2 > 0.9999
    # a run's fits without slices keep its configured all-to-all coefficient in effect
    layout, fit = fit_layout(), CostFit(rank=0, attn_coef=0.0, patch_coef=0.0, a2a_coef=0.3)
    for start in (0, 32, 64):
        for row in rows[start:start + 32]:
            fit.observe(row)
        fit.merge(layout.decode(layout.encode(**fit.fields())[None]))
    assert fit.fitted.attn_coef > 0 and fit.coefficients[2] == 0.3


def test_the_all_to_all_term_is_held_between_0_and_MAX_A2A():
    """Noisy slices a little faster than the law without the term: the free fit's all-to-all term
    is negative; the fit holds it at 0 and is the fit without it. An all-to-all slower than
    MAX_A2A tokens a token is held at MAX_A2A."""
    rows = observations(160, seed=17, noise=0.02) + slices(96, seed=18, noise=0.02, e=-0.3)
    assert free_fit(rows, ("tokens", "area", "patches", "a2a"))[3] < 0
    fitted = fit_coefficients(rows)
    without = fit_coefficients([o._replace(a2a=0) for o in rows])
    assert fitted.a2a_coef == 0.0 and fitted == without._replace(a2a_coef=0.0)
    slow = fit_coefficients(observations(160, seed=19) + slices(96, seed=20, e=2 * MAX_A2A * A))
    assert slow.a2a_coef == MAX_A2A
    assert slow.attn_coef == pytest.approx(B / A, rel=1e-3) and slow.patch_coef == pytest.approx(C / A, rel=1e-3)


def test_ranks_exchanging_slice_times_agree_on_every_coefficient():
    """Three ranks' CostFits, their fields through the wire layout each round: every rank holds the
    same window and takes rank 0's fit of the window as it stood a round before, all three
    coefficients (the all-to-all's bits too) the same floats; a change of any of them is one."""
    world, rounds, layout = 3, 6, fit_layout()
    fits = [CostFit(rank=rank, attn_coef=0.0, patch_coef=0.0) for rank in range(world)]
    times = []
    for rank in range(world):
        rows = observations(10 * rounds, seed=21 + rank) + slices(6 * rounds, seed=31 + rank)
        times.append([rows[i] for i in np.random.default_rng(rank).permutation(len(rows))])
    expected = (0.0, 0.0, 0.0)
    for index in range(rounds):
        for fit, rows in zip(fits, times, strict=True):
            for row in rows[16 * index:16 * (index + 1)]:
                fit.observe(row)
        gathered = layout.decode(np.stack([layout.encode(**fit.fields()) for fit in fits]))
        changed = [fit.merge(gathered) for fit in fits]
        assert all(fit.coefficients == expected for fit in fits) and len(set(changed)) == 1
        assert all(list(fit.window) == list(fits[0].window) for fit in fits)
        solved = fit_coefficients(list(fits[0].window))  # (what rank 0 sends next)
        if solved:  # (an all-to-all term the window does not tell leaves the one in effect)
            expected = (solved.attn_coef, solved.patch_coef,
                        expected[2] if solved.a2a_coef is None else solved.a2a_coef)
    assert fits[1].fitted == fits[0].fitted and fits[0].fitted.a2a_coef == pytest.approx(E / A, rel=1e-3)
    # a fit that moves the all-to-all term alone is a change (the batcher prices its window again)
    attn, patch, a2a = fits[0].coefficients
    assert CostFit(rank=1, attn_coef=attn, patch_coef=patch).merge(gathered)
    assert not CostFit(rank=1, attn_coef=attn, patch_coef=patch, a2a_coef=a2a).merge(gathered)


def old_format(fit: dict) -> dict:
    """A CostFit state as the release before the all-to-all term wrote it: two coefficients, fits
    of four values, observations of four."""
    return {"coefficients": fit["coefficients"][:2],
            **{key: fit[key][:4] if fit[key] else None for key in ("fitted", "solved")},
            **{key: [o[:4] for o in fit[key]] for key in ("window", "unsent")}}


def test_a_state_written_before_the_all_to_all_term_loads_and_resumes():
    """A CostFit state of the last release loads with a2a 0 (coefficient, fits, observations) and
    is this version's state of a run without slices; batcher states whose fit is in that format
    resume as the uninterrupted run."""
    fit = CostFit(rank=0, attn_coef=0.0, patch_coef=0.0)
    layout = fit_layout()
    for index in range(2):
        for row in observations(20, seed=41 + index):
            fit.observe(row)
        fit.merge(layout.decode(layout.encode(**fit.fields())[None]))  # (one rank: its own times)
    for row in observations(5, seed=43):  # (not sent yet)
        fit.observe(row)
    state = roundtrip(fit.state_dict())
    assert state["fitted"] and state["solved"] and state["unsent"]  # (every part of the state is there)
    old = old_format(state)
    assert (len(old["coefficients"]), len(old["fitted"]), len(old["window"][0])) == (2, 4, 4)
    configured = CostFit(rank=0, attn_coef=1.0, patch_coef=1.0, a2a_coef=0.7)  # (the run's setting, for a2a)
    configured.load_state_dict(old)
    assert configured.coefficients == (*old["coefficients"], 0.7)
    loaded = CostFit(rank=0, attn_coef=1.0, patch_coef=1.0, a2a_coef=state["coefficients"][2])
    loaded.load_state_dict(old)
    assert loaded.coefficients == (*old["coefficients"], state["coefficients"][2]) and loaded.fitted.a2a_coef is None
    assert all(o.a2a == 0 for o in [*loaded.window, *loaded.unsent])
    assert roundtrip(loaded.state_dict()) == state

    rng = np.random.default_rng(4)
    lengths = [(int(t), 0) for t in rng.integers(20, 1500, size=400)]
    config = OdbConfig(max_tokens=2048, window=24, gas=1, lookahead=8)
    whole = simulate(config, lengths, 2, train=micro_seconds)
    cut = 40
    states: list = [None, None]

    def make(comm):
        return OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))

    def first_part(comm):
        batcher = make(comm)
        steps = timed(batcher, comm.rank, stop=cut)
        states[comm.rank] = roundtrip(batcher.state_dict())
        return steps

    def second_part(comm):
        batcher = make(comm)
        batcher.load_state_dict({**states[comm.rank], "fit": old_format(states[comm.rank]["fit"])})
        batcher.is_warm = True  # (the uninterrupted run skipped only its very first step's times)
        return timed(batcher, comm.rank)

    first = run_ranks(2, first_part)
    assert states[0]["fit"]["fitted"] is not None
    second = run_ranks(2, second_part)
    assert [first[rank] + second[rank] for rank in range(2)] == whole.steps
