#!/usr/bin/env python
"""Data pipeline throughput: processed samples/s through DataLoader workers, as the trainer pulls them.

    python tools/bench/bench_data.py --workers 0 1 2

For the bundled chat set and the bundled multimodal set (images resized and patchified), deals
every sample to one rank's feed and fetches them in windows, as the batcher does; prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from odb.data.feed import SampleFeed  # noqa: E402
from odb.data.processing import DataConfig, SampleDataset, sample_sizes  # noqa: E402
from odb.training.model.build import build_model, load_tokenizer, vision_spec  # noqa: E402


def measure(dataset: SampleDataset, workers: int, epochs: int, window: int) -> float:
    feed = SampleFeed(dataset, sample_sizes, num_workers=workers, prefetch_factor=4)
    uids = list(range(len(dataset) * epochs))
    feed.deal(uids)
    feed.fetch(uids[:window])  # workers started, first batch out: not part of the rate
    start = time.perf_counter()
    for at in range(window, len(uids), window):
        chunk = uids[at:at + window]
        feed.fetch(chunk)
        for uid in chunk:
            feed.store.pop(uid, None)
    rate = (len(uids) - window) / (time.perf_counter() - start)
    feed.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    vl = build_model(ROOT / "configs" / "tiny_vl_model.json", seed=0, vocab_size=len(tokenizer))
    sets = {"chat (2000 samples x 2 epochs)": (SampleDataset(ROOT / "data" / "chat.jsonl", tokenizer), 2),
            "multimodal (300 samples x 2 epochs)": (SampleDataset(
                ROOT / "data" / "mm" / "train.jsonl", tokenizer, vision=vision_spec(vl, DataConfig())), 2)}
    print("| data | " + " | ".join(f"{w} workers" for w in args.workers) + " |")
    print("|---|" + "---|" * len(args.workers))
    for name, (dataset, epochs) in sets.items():
        rates = [measure(dataset, w, epochs, args.window) for w in args.workers]
        print(f"| {name} | " + " | ".join(f"{r:.0f} samples/s" for r in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
