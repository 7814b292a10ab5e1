#!/usr/bin/env python
"""A saved checkpoint as a Hugging Face model folder: ``odb export`` (odb/cli/export.py says how),
run from the checkout.

    python tools/export_hf.py runs/default/checkpoints/step200 runs/default/hf
    python tools/export_hf.py runs/lora/checkpoints runs/lora/adapter --adapter_only
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from odb.cli.export import main  # noqa: E402

__all__ = ["main"]

if __name__ == "__main__":
    main(prog="export_hf")
