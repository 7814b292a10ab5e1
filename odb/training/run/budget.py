"""The budget search of ``max_tokens: "auto"``: the largest budget whose measured step fits a memory cap.

Pure logic over a ``measure(budget) -> peak`` function (the preflight's worst-case step,
:mod:`odb.training.run.preflight`), so it is tested against a brute force on synthetic memory curves.
Budgets are multiples of :data:`QUANTUM`. The search assumes the peak grows with the budget (more
tokens never take less memory) and keeps every trial it ran:

* it starts at ``start`` and doubles while the step fits, never past where the straight line
  through the last two trials crosses the cap (a step well over the cap may not only be over: on a
  GPU it runs out of memory, and a rank that fails mid-step can leave the others in a collective);
* once a budget fits and the next one up does not, it narrows that bracket, trying where the line
  through its two ends crosses the cap (near the answer when memory grows about linearly with
  tokens, as with varlen attention), or the middle when that guess did not shrink the bracket
  much, until the bracket is one quantum wide: the lower end is the answer, the upper end was
  measured over the cap;
* it gives up after ``max_trials`` trials with the largest budget that fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BudgetTrial", "QUANTUM", "search_budget"]

QUANTUM = 64
"""Budgets are multiples of this (tensor-core friendly shapes; a coarser search needs fewer steps)."""


@dataclass(frozen=True)
class BudgetTrial:
    budget: int
    peak: float
    fits: bool


def _down(value: float) -> int:
    return int(value // QUANTUM) * QUANTUM


def search_budget(measure: Callable[[int], float], cap: float, *, upper: int, start: int = 1024,
                  max_trials: int = 16) -> tuple[int | None, list[BudgetTrial]]:
    """The largest multiple of :data:`QUANTUM` in ``[QUANTUM, upper]`` whose ``measure`` is at most
    ``cap`` (None if not even :data:`QUANTUM` fits), and the trials, in the order run.

    ``upper`` is rounded down to a multiple of :data:`QUANTUM` (at least one quantum)."""
    upper = max(QUANTUM, _down(upper))
    trials: list[BudgetTrial] = []
    lo: int | None = None  # the largest budget measured to fit
    hi: int | None = None  # the smallest budget measured not to fit

    def run(budget: int) -> None:
        nonlocal lo, hi
        peak = float(measure(budget))
        fits = bool(peak <= cap)
        trials.append(BudgetTrial(budget, peak, fits))
        if fits:
            lo = budget if lo is None else max(lo, budget)
        else:
            hi = budget if hi is None else min(hi, budget)

    run(min(upper, max(QUANTUM, _down(start))))
    while len(trials) < max_trials:
        if lo is not None and (lo == upper or hi is not None and hi - lo <= QUANTUM):
            break  # the answer is lo: upper itself, or the next budget up was measured over the cap
        if lo is None:  # nothing fits yet: go down
            if hi == QUANTUM:
                break  # not even one quantum fits
            guess = _crossing(trials, cap)
            nxt = _down(hi / 2) if guess is None else min(_down(hi / 2), _down(guess))
            run(max(QUANTUM, nxt))
            continue
        guess = _crossing(trials, cap)
        if hi is None:  # everything so far fits: double, but not past the line's crossing
            nxt = min(upper, 2 * lo)
            if guess is not None and guess > lo:
                nxt = min(nxt, max(lo + QUANTUM, _down(guess)))
            run(nxt)
            continue
        middle = _down((lo + hi) / 2)
        nxt = middle if guess is None else min(hi - QUANTUM, max(lo + QUANTUM, _down(guess)))
        narrowing = len(trials) >= 2 and trials[-1].fits == trials[-2].fits
        if narrowing:  # the line's guesses keep landing on one side: halve the bracket instead
            nxt = max(lo + QUANTUM, middle)
        run(nxt)
    return lo, trials


def _crossing(trials: list[BudgetTrial], cap: float) -> float | None:
    """Where the straight line through the last two trials of different budgets reaches ``cap``
    (None when there are not two, or the peak did not grow between them)."""
    points = []
    for trial in reversed(trials):
        if all(trial.budget != b for b, _ in points):
            points.append((trial.budget, trial.peak))
        if len(points) == 2:
            break
    if len(points) < 2:
        return None
    (b1, p1), (b0, p0) = points
    if b1 == b0 or (p1 - p0) / (b1 - b0) <= 0:
        return None
    return b0 + (cap - p0) * (b1 - b0) / (p1 - p0)
