"""Rank 0's writer of ``metrics.jsonl`` (and of a sink such as W&B's ``log``): step rows as their
rounds complete, each evaluation's row after the rows of the steps before it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter"]


class MetricsWriter:
    """Appends to ``path`` (created if missing); ``sink``: an extra consumer of each row, or None."""

    def __init__(self, path: Path, sink: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.file = open(path, "a")
        self.sink = sink
        self.evals: list[dict[str, Any]] = []  # eval rows not yet written

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
