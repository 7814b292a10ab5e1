#!/usr/bin/env python
"""Chat records whose lengths follow a length trace (one ``tokens [patches]`` line per sample, as
in the shared traces), for training benchmarks on realistic length profiles without the real data.

    python tools/make/make_trace_data.py --trace ../shared/traces/sharegpt4o_like.txt --samples 2000 \\
        --out runs/trace_data.jsonl

Each record is one user turn (a quarter of the sample) and one assistant answer (the rest), made
of words that the bundled tokenizer reads as one token each, so that a sample templated with the
bundled tokenizer has about the trace's token count (within the template's few tokens). Seeded.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.traces import read_lengths  # noqa: E402


def one_token_words(tokenizer) -> list[str]:
    """Words the tokenizer encodes, after a space, as exactly one token."""
    words = sorted({token[1:] for token in tokenizer.get_vocab() if token.startswith("Ġ") and token[1:].isalpha()})
    return [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]


def write_records(lengths: list[int], out: Path, *, seed: int = 0, max_tokens: int | None = None) -> None:
    """One chat record per length (see the module docstring), seeded."""
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer"))
    words = one_token_words(tokenizer)
    rng = random.Random(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for tokens in lengths:
            tokens = min(tokens, max_tokens) if max_tokens else tokens
            body = max(2, tokens - 8)  # the template's own tokens
            user = max(1, body // 4)
            record = {"messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=user))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=max(1, body - user)))}]}
            f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=2000, help="the first N lengths of the trace")
    parser.add_argument("--max_tokens", type=int, default=None, help="cap each length (default: none)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = [tokens for tokens, _ in read_lengths(str(args.trace))[:args.samples]]
    write_records(lengths, args.out, seed=args.seed, max_tokens=args.max_tokens)
    print(f"wrote {len(lengths)} records to {args.out} (mean {sum(lengths) / max(1, len(lengths)):.0f} tokens)")


if __name__ == "__main__":
    main()
