#!/usr/bin/env python
"""Writes the settings tables of docs/settings.md (between its marker lines) from the code: the
flags of launch/train.py and the keys of odb's, the data's and FSDP2's JSON, with their defaults
and docstrings (odb/training/launch/settings_docs.py).

    python tools/make/settings_tables.py            # rewrite the tables
    python tools/make/settings_tables.py --check    # exit 1 if they differ from the code
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from odb.training.launch.settings_docs import BEGIN, END, settings_tables  # noqa: E402

PAGE = ROOT / "docs" / "settings.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when they differ")
    args = parser.parse_args()
    text = PAGE.read_text()
    head, rest = text.split(BEGIN + "\n", 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{BEGIN}\n{settings_tables(ROOT)}{END}{tail}"
    if args.check:
        if updated != text:
            sys.exit(f"{PAGE} differs from the code: run python tools/make/settings_tables.py")
        print(f"{PAGE}: the settings tables match the code")
        return
    PAGE.write_text(updated)
    print(f"wrote the settings tables of {PAGE}")


if __name__ == "__main__":
    main()
