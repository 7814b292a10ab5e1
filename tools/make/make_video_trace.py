#!/usr/bin/env python
"""A synthetic length trace of mixed text, image and video samples, with its distribution stated.

    python tools/make/make_video_trace.py --samples 16000 --out runs/video_mix.txt

No public video-SFT set can be downloaded here, so the trace is drawn from a stated distribution
(seeded), shaped after what Qwen2.5-VL-style video SFT feeds a model: one ``tokens patches`` line
per sample (tokens: text plus visual tokens; patches: vision-encoder patches, 4 per visual token,
``merge_size`` 2), as the shared traces have them.

* **text** (40%): lognormal tokens, median 500, sigma 0.9, within 30..8000.
* **image** (35%): one image of ``h x w`` visual tokens, each side uniform in 8..32 (224..896
  pixels at 28 pixels per token), and a lognormal text part (median 150, sigma 0.8, 10..2000).
* **video** (25%): a clip of lognormal duration (median 30 s, sigma 0.9, within 2..300 s)
  sampled at 2 frames a second, at most 64 frames (the common cap of video SFT recipes), at
  least 4, an even count; every frame 12 x 21 visual tokens (a 16:9 frame within ``256 x 28 x
  28`` pixels, ``video_max_pixels``); two frames make one temporal group, so a clip has
  ``frames / 2 x 12 x 21`` visual tokens; a lognormal text part (median 120, sigma 0.7, 10..1500).

A 64-frame clip is then 8064 visual tokens (32256 patches) next to a 30-token text turn: the
spread a fixed batch sizes for its longest sample.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

SHARES = (("text", 0.40), ("image", 0.35), ("video", 0.25))
FRAME_TOKENS = 12 * 21  # a 16:9 frame within 256 x 28 x 28 pixels: 12 x 21 merged patches


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, median * math.exp(rng.gauss(0.0, sigma))))


def sample(rng: random.Random) -> tuple[str, int, int]:
    """``(kind, tokens, patches)`` of one sample of the stated distribution."""
    kind = rng.choices([k for k, _ in SHARES], weights=[w for _, w in SHARES])[0]
    if kind == "text":
        return kind, round(_lognormal(rng, 500, 0.9, 30, 8000)), 0
    if kind == "image":
        visual = rng.randint(8, 32) * rng.randint(8, 32)
        return kind, visual + round(_lognormal(rng, 150, 0.8, 10, 2000)), 4 * visual
    seconds = _lognormal(rng, 30, 0.9, 2, 300)
    frames = max(4, min(64, int(2 * seconds)) // 2 * 2)
    visual = frames // 2 * FRAME_TOKENS
    return kind, visual + round(_lognormal(rng, 120, 0.7, 10, 1500)), 4 * visual


def trace(samples: int, seed: int = 0) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    return [sample(rng) for _ in range(samples)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="the trace: one 'tokens patches' line per sample")
    parser.add_argument("--kinds", type=Path, help="also each sample's kind (text, image, video), one per line")
    args = parser.parse_args(argv)
    rows = trace(args.samples, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(f"{tokens} {patches}\n" for _, tokens, patches in rows))
    if args.kinds:
        args.kinds.write_text("".join(f"{kind}\n" for kind, _, _ in rows))
    tokens = [t for _, t, _ in rows]
    mean = sum(tokens) / len(tokens)
    cv = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens)) / mean
    counts = {k: sum(1 for kind, _, _ in rows if kind == k) for k, _ in SHARES}
    print(f"{len(rows)} samples {counts}: mean {mean:.0f} tokens, CV {cv:.2f}, max {max(tokens)}; "
          f"patches mean {sum(p for _, _, p in rows) / len(rows):.0f}, max {max(p for _, _, p in rows)}")


if __name__ == "__main__":
    main()
