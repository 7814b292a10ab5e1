#!/usr/bin/env python
"""Show what a run would train on, each label run decoded: ``odb show-labels`` (odb/cli/show_labels.py
says how), run from the checkout.

    python tools/show_labels.py --tokenizer /models/Qwen2.5-7B-Instruct --data chats.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from odb.cli.show_labels import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    main(prog="show_labels")
