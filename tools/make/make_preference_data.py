#!/usr/bin/env python
"""Writes the bundled preference demo data: data/preference.jsonl, 40 pairs in every format odb reads.

    python tools/make/make_preference_data.py   # -> data/preference.jsonl

The tasks of data/chat.jsonl (repeat, reverse, sort, count, small talk: :mod:`make_bundled_data`),
each with a correct answer (chosen) and a wrong one (rejected) of a very different length: a long
correct list against a short refusal, or a short correct count against a long ramble, so that a
pair's two sequences cost very differently and truncation has the longer answer to cut. The
records go round the formats of :mod:`odb.data.preference` (a: TRL plain; b: TRL conversational,
explicit prompt; c: UltraFeedback-binarized; d: TRL implicit prompt; e: ``messages`` or ShareGPT
``conversations`` prompt turns, some with a ``system`` field), eight of each. Deterministic (seeded).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.make.make_bundled_data import SYSTEMS, WORDS, turn  # noqa: E402

DATA = REPO / "data"
FORMATS = ("a", "b", "c", "d", "e")
REFUSALS = ("I cannot do that.", "No.", "Maybe later.", "I am not sure.")


def wrong(rng: random.Random, user: str, right: str) -> str:
    """A wrong answer of a very different length from ``right``: short where it is long, long where it is short."""
    if len(right.split()) > 12:
        return rng.choice(REFUSALS)
    ramble = [rng.choice(WORDS) for _ in range(rng.randrange(80, 400))]
    return "Let me think about " + user.split(":")[0].lower() + ": " + " ".join(ramble)


def record(rng: random.Random, fmt: str) -> dict:
    """One preference record in format ``fmt``, with one or two exchanges of history before the prompt at times."""
    history = []
    if fmt in ("b", "d", "e") and rng.random() < 0.3:
        user, assistant = turn(rng)
        history = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    user, right = turn(rng)
    chosen, rejected = (right, wrong(rng, user, right)) if rng.random() < 0.8 else (wrong(rng, user, right), right)
    prompt = history + [{"role": "user", "content": user}]
    if fmt == "a":
        return {"prompt": user, "chosen": chosen, "rejected": rejected}
    if fmt == "b":
        return {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}
    if fmt == "c":
        return {"prompt": user, "chosen": prompt + [{"role": "assistant", "content": chosen}],
                "rejected": prompt + [{"role": "assistant", "content": rejected}]}
    if fmt == "d":
        system = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
        return {"chosen": system + prompt + [{"role": "assistant", "content": chosen}],
                "rejected": system + prompt + [{"role": "assistant", "content": rejected}]}
    system = {"system": rng.choice(SYSTEMS)} if rng.random() < 0.5 else {}
    if rng.random() < 0.5:
        return {"messages": prompt, **system, "chosen": chosen, "rejected": rejected}
    sharegpt = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in prompt]
    return {"conversations": sharegpt, **system, "chosen": {"from": "gpt", "value": chosen},
            "rejected": {"from": "gpt", "value": rejected}}


def rows(num_records: int = 40) -> list[dict]:
    """The records of data/preference.jsonl, round the formats in turn."""
    rng = random.Random(20260611)
    return [record(rng, FORMATS[i % len(FORMATS)]) for i in range(num_records)]


def main() -> None:
    with open(DATA / "preference.jsonl", "w") as f:
        for row in rows():
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
