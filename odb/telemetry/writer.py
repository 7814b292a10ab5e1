"""Rank 0's writer of ``metrics.jsonl`` (and of a sink such as W&B's ``log``): step rows as their
rounds complete, each evaluation's row after the rows of the steps before it.

A resumed process (``--resume``) continues the file from its checkpoint's step ``K``: the rows an
earlier process wrote of steps ``K`` and later (it trained past its last checkpoint, then died
without saving: a hard crash, or a resume from an older tag) are of steps the resume trains
again, so :func:`supersede_rows` moves them out of the file, as they were, to the end of
:data:`SUPERSEDED` beside it, before the first row of the resumed process. ``metrics.jsonl`` then
holds every step once, in order; nothing is lost."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SUPERSEDED", "MetricsWriter", "Superseded", "supersede_rows"]

SUPERSEDED = "metrics.superseded.jsonl"
"""Beside ``metrics.jsonl``: the rows that resumed processes superseded, appended as they were."""


@dataclass(frozen=True)
class Superseded:
    """What :func:`supersede_rows` moved aside: ``rows`` lines, the rows of steps ``first`` to
    ``last`` (None: none, only torn lines) and ``torn`` lines cut by a kill, which no reader parses."""

    rows: int
    first: int | None
    last: int | None
    torn: int = 0

    @property
    def steps(self) -> str | None:
        """``"first-last"``, or None where only torn lines moved."""
        return None if self.first is None else f"{self.first}-{self.last}"


def _step(line: str) -> int | None:
    """A row's step, or None for a line that is not a row (cut by a kill)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def supersede_rows(path: Path, from_step: int) -> Superseded | None:
    """Moves the rows of steps ``from_step`` and later (training and evaluation rows; an evaluation
    after step ``s`` is a row of step ``s``) and any torn line out of ``path``, to the end of
    :data:`SUPERSEDED` in the same folder; the other rows stay, in their order. Returns what moved,
    None when nothing did (the file is then left as it is).

    The superseded rows are written (and synced) before ``path`` is replaced by its kept rows in one
    rename, so a process killed in between leaves every row in one of the files or in both."""
    if not path.is_file():
        return None
    kept, moved, steps, torn = [], [], [], 0
    with open(path) as rows:
        for line in rows:
            text = line.rstrip("\n")
            if not text.strip():
                continue
            step = _step(text)
            if step is not None and step < from_step:
                kept.append(text)
                continue
            moved.append(text)
            if step is None:
                torn += 1
            else:
                steps.append(step)
    if not moved:
        return None
    with open(path.with_name(SUPERSEDED), "a") as aside:
        aside.write("".join(text + "\n" for text in moved))
        aside.flush()
        os.fsync(aside.fileno())
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as rewritten:
        rewritten.write("".join(text + "\n" for text in kept))
        rewritten.flush()
        os.fsync(rewritten.fileno())
    os.replace(temporary, path)
    return Superseded(rows=len(moved), first=min(steps, default=None), last=max(steps, default=None), torn=torn)


class MetricsWriter:
    """Appends to ``path`` (created if missing); ``sink``: an extra consumer of each row, or None."""

    def __init__(self, path: Path, sink: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.path = path
        self.file = open(path, "a")
        self.sink = sink
        self.evals: list[dict[str, Any]] = []  # eval rows not yet written

    def supersede(self, from_step: int) -> Superseded | None:
        """A resumed process's first step is ``from_step``: an earlier process's rows of it and
        later steps go to :data:`SUPERSEDED` (:func:`supersede_rows`). Before any row is written."""
        self.file.close()
        try:
            return supersede_rows(self.path, from_step)
        finally:
            self.file = open(self.path, "a")

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
            if self.sink is not None:
                self.sink(row)
        self.file.flush()

    def add_eval(self, row: dict[str, Any]) -> None:
        """An evaluation's row, written once the rows of its step are (:meth:`write_evals`)."""
        self.evals.append(row)

    def write_evals(self, up_to: int | None = None) -> None:
        """Writes the eval rows of steps up to ``up_to`` (None: all), after those steps' rows (they
        arrive in step order, so the ready ones lead)."""
        ready = [row for row in self.evals if up_to is None or row["step"] <= up_to]
        self.evals = self.evals[len(ready):]
        self.write(ready)

    def close(self) -> None:
        self.file.close()
