#!/usr/bin/env python
"""Check that odb trains your model as the model itself would, before a long run on it: ``odb
check-model`` (odb/cli/check_model.py says how), run from the checkout.

    python tools/check_model.py /models/Qwen3-30B-A3B --data my_sft.jsonl --samples 8
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from odb.cli.check_model import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(prog="check_model"))
