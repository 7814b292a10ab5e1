#!/usr/bin/env python
"""Training benchmark with videos: fixed batches, gmt and odb on a tiny Qwen2-VL that takes videos,
over text, image and video samples of the stated mixed trace (tools/make/make_video_trace.py).

    python tools/bench/bench_video.py --samples 240 --length_scale 8 --max_tokens 2048 --world_size 2 --json

Each sample of the trace (its lengths divided by ``--length_scale``) becomes a real record: text
of its text tokens; an image of ``a x a`` visual tokens (a PNG of noise, ``28a`` pixels a side); or
a video of ``t`` temporal groups of ``a x a`` visual tokens (an MPEG-4 file of ``2t`` noise frames
at 2 frames a second, sampled whole at ``video_fps`` 2), through the real pipeline: decoding and
the video processor in the DataLoader workers, the model's vision tower on every patch. The model
is configs/tiny_vl_model.json with its tokenizer, data/vl_tokenizer (the bundled tokenizer plus
``<|video_pad|>``, its video token). The runs are tools/bench/bench_train.py's (ZeRO-2, one epoch, the same initial
weights, samples and schedule; ``fixed``: the largest padded batch whose batch of the longest
samples fits ``max_tokens``; ``gmt``: the offline oracle with every length up front). The paper's
package is not run: it batches text only.

Reports per system samples/s, padding, sync efficiency and the vision patches per micro-batch
(mean and largest), as a markdown table and, with ``--json``, one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tools.bench.bench_train import bench, figures, micro_batches, parse_run_arguments, run_project  # noqa: E402
from tools.make.make_video_trace import trace  # noqa: E402

SYSTEMS = ("fixed", "gmt", "odb")
FRAME_TOKENS = 16  # a video's visual tokens per temporal group, aimed at (4 x 4: 112-pixel frames)


def media_sizes(kind: str, tokens: int, patches: int, scale: int) -> tuple[int, int, int]:
    """``(text tokens, groups, side)`` of a trace sample at ``1 / scale``: an image of ``side x
    side`` visual tokens (groups 1), a video of ``groups`` temporal groups of them, or text alone."""
    visual = patches // 4
    text = max(4, (tokens - visual) // scale)
    if kind == "text":
        return text, 0, 0
    visual = max(4, visual // scale)
    if kind == "image":
        return text, 1, max(1, round(math.sqrt(visual)))
    groups = min(32, max(2, visual // FRAME_TOKENS))
    return text, groups, max(1, round(math.sqrt(visual / groups)))


def write_media(path: Path, groups: int, side: int, rng: np.random.Generator, video: bool) -> None:
    pixels = 28 * side
    if not video:
        from PIL import Image

        Image.fromarray(rng.integers(0, 256, (pixels, pixels, 3), dtype=np.uint8)).save(path)
        return
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width = stream.height = pixels
        stream.pix_fmt = "yuv420p"
        for _ in range(2 * groups):
            frame = rng.integers(0, 256, (pixels, pixels, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def prepare(args: argparse.Namespace, work: Path) -> dict:
    """The records and their media, the model folder, the data settings; what the runs share."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from odb.data.images import vision_spec_for
    from odb.data.processing import DataConfig, SampleDataset
    from odb.training.model.build import load_tokenizer, vision_spec
    from tools.make.make_trace_data import one_token_words
    from tools.sim.simulate_cluster import fixed_batch_for

    tokenizer = load_tokenizer(ROOT / "data" / "vl_tokenizer")
    settings = json.loads((ROOT / "configs" / "tiny_vl_model.json").read_text())
    torch.manual_seed(args.seed)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**settings))
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    vision_spec_for(model.config).build().save_pretrained(model_dir)  # the family's image processor

    words, rng, noise = one_token_words(tokenizer), random.Random(args.seed), np.random.default_rng(args.seed)
    media, records, kinds = work / "media", [], []
    media.mkdir(parents=True, exist_ok=True)
    for i, (kind, tokens, patches) in enumerate(trace(args.samples, args.seed)):
        text, groups, side = media_sizes(kind, tokens, patches, args.length_scale)
        said = " ".join(rng.choice(words) for _ in range(text))
        cut = max(1, len(said.split()) // 4)
        question, answer = " ".join(said.split()[:cut]), " ".join(said.split()[cut:]) or "yes"
        content: list[dict] = [{"type": "text", "text": question}]
        if groups:
            name = f"{i}.mp4" if kind == "video" else f"{i}.png"
            write_media(media / name, groups, side, noise, kind == "video")
            content.insert(0, {"type": kind, kind: f"media/{name}"})
        records.append({"messages": [{"role": "user", "content": content},
                                     {"role": "assistant", "content": answer}]})
        kinds.append(kind)
    data = work / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    data_settings = {"min_pixels": 28 * 28, "max_pixels": 10 ** 7, "video_fps": 2.0, "video_min_pixels": 28 * 28,
                     "video_max_pixels": 10 ** 7, "video_max_frames": 64}
    (work / "data.json").write_text(json.dumps(data_settings))

    data_config = DataConfig(**data_settings)
    dataset = SampleDataset(data, tokenizer, data_config, seed=args.seed, truncate_to=args.max_tokens,
                            vision=vision_spec(model, data_config, model_dir))
    samples = [dataset[i] for i in range(len(dataset))]
    skipped = [s["detail"] for s in samples if "skip" in s]
    if skipped:
        raise RuntimeError(f"{len(skipped)} records skipped, e.g. {skipped[0]}")
    lengths = {i: len(s["input_ids"]) for i, s in enumerate(samples)}
    patches = {i: int(s["patches"]) for i, s in enumerate(samples)}
    return {"data": data, "model": model_dir, "dataset_size": len(dataset), "lengths": lengths, "patches": patches,
            "kinds": Counter_of(kinds), "data_config": work / "data.json",
            "safe_batch": fixed_batch_for([(n, 0) for n in lengths.values()], args.max_tokens)}


def Counter_of(kinds: list[str]) -> dict[str, int]:  # noqa: N802 (a plain count, named for the report)
    return {k: kinds.count(k) for k in ("text", "image", "video")}


def patch_figures(out: Path, shared: dict) -> dict:
    """Vision patches per (non-dummy) micro-batch, from the run's audit."""
    per = [sum(shared["patches"][i] for i in ids) for ids in micro_batches(out) if ids]
    return {"patches_per_micro_batch_mean": round(sum(per) / max(1, len(per)), 1),
            "patches_per_micro_batch_max": max(per, default=0)}


def markdown(result: dict) -> str:
    base = result["systems"].get("odb", {}).get("samples_per_s")
    lines = ["| system | samples/s | odb is | padding | sync efficiency | steps | micro-batches | patches per "
             "micro-batch (mean / max) | final loss | trained once |", "|" + "---|" * 10]
    for name, r in result["systems"].items():
        label = f"fixed (batch {r['batch_size']})" if name == "fixed" else name
        speed = f"{base / r['samples_per_s']:.2f}x" if base and r["samples_per_s"] else "-"
        lines.append(f"| {label} | {r['samples_per_s']:.2f} | {speed} | {r['padding_ratio']:.3f} | "
                     f"{r['sync_efficiency']:.3f} | {r['steps']} | {r['micro_batches']} | "
                     f"{r['patches_per_micro_batch_mean']:.0f} / {r['patches_per_micro_batch_max']} | "
                     f"{r['final_loss']:.3f} | {r['coverage']['once']}/{result['samples']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--length_scale", type=int, default=8, help="divide the trace's lengths by this")
    parser.add_argument("--max_tokens", type=int, default=2048)
    parser.add_argument("--world_size", type=int, default=2, choices=(1, 2, 4, 8))
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    return parse_run_arguments(parser, argv, SYSTEMS)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def run_one(system: str, shared: dict, work: Path) -> dict:
        out = run_project(system, args, shared, work, ["--data_config", str(shared["data_config"])])
        return {**figures(system, out, shared), **patch_figures(out, shared)}

    return bench("bench_video", args, prepare, lambda shared: {
        "trace": "make_video_trace", "samples": shared["dataset_size"], "kinds": shared["kinds"]}, run_one, markdown)


if __name__ == "__main__":
    main()
