"""Length traces (``../shared/traces/*.txt`` and the like), read the same way by every tool:
one sample per line, ``tokens [vision_patches]``."""

from __future__ import annotations

from pathlib import Path


def read_lengths(path: str) -> list[tuple[int, int]]:
    """One sample per line: ``tokens [vision_patches]``."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            out.append((int(parts[0]), int(parts[1]) if len(parts) > 1 else 0))
        except ValueError:
            raise SystemExit(f"{path}:{number}: expected 'tokens [vision_patches]', got {line!r}")
    return out
