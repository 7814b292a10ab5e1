"""The preflight of a model that takes videos (odb/training/run/preflight.py): its worst case holds the
most video a micro-batch of the budget can hold, through the real engine and model.

The oracle shares no odb code: the largest frame of a clip is found by brute force over frame sizes
with transformers' own ``smart_resize`` (read from its source, tests/unit/test_videos.py), the
token layout is the family's processor's (Qwen2-VL: start, one video token per visual token, end;
Qwen3-VL: inside an outer start and end, each temporal group's ``<t.t seconds>`` and its own start,
tokens and end), and the probe is what the model's vision tower and forward received."""

from __future__ import annotations

import functools

import pytest
from test_videos import QWEN2, QWEN3, their

from odb.batching.align import SimulatedGroup
from odb.batching.config import OdbConfig
from odb.training.backends.base import LocalBackend
from odb.training.config.settings import DataSettings, ModelSettings, PreflightSettings, RunConfig
from odb.training.model.build import build_model, vision_spec
from odb.training.run.preflight import run_preflight
from video_data import IDS, SMALL, VIDEO_TOKENIZER, config_file

BUDGET, FACTOR, MERGE2 = 400, 28, 4  # (the test models: 14-pixel patches, 2 x 2 merged)
START, END, VIDEO, IMAGE = IDS["vision_start_token_id"], IDS["vision_end_token_id"], IDS["video_token_id"], \
    IDS["image_token_id"]


@functools.cache
def frame_squares(family: str, frames: int) -> list[int]:
    """Every frame size transformers' video processor makes of a clip of ``frames`` frames under
    SMALL's bounds, as merged squares (visual tokens a temporal group), by brute force over frames
    of 1 to 200 squares a side (frames of any aspect up to 200: a thin one comes out over the
    bound, which holds only 8 squares)."""
    resize = their(QWEN2 if family != "qwen3_vl" else QWEN3, "smart_resize")
    low, high = SMALL.video_min_pixels, SMALL.video_max_pixels
    made = set()
    for rows in range(1, 201):
        for cols in range(1, 201):
            try:
                if family == "qwen3_vl":
                    height, width = resize(frames, rows * FACTOR, cols * FACTOR, 2, FACTOR, low, high)
                else:
                    height, width = resize(rows * FACTOR, cols * FACTOR, factor=FACTOR, min_pixels=low, max_pixels=high)
            except ValueError:  # (an aspect ratio over 200)
                continue
            made.add(height * width // FACTOR ** 2)
    return sorted(made)


def clip_ids(family: str, groups: int, squares: int) -> list[int]:
    """A clip's tokens as the family's processor lays them out (SMALL samples at 2 frames a second:
    group g's time is the mean of frames 2g and 2g + 1)."""
    if family != "qwen3_vl":
        return [START, *[VIDEO] * (groups * squares), END]
    body = []
    for g in range(groups):
        stamp = VIDEO_TOKENIZER(f"<{(4 * g + 1) / 4:.1f} seconds>", add_special_tokens=False)["input_ids"]
        body += [*stamp, START, *[VIDEO] * squares, END]
    return [START, *body, END]


def probe(tmp_path, family: str, max_patches: int | None) -> tuple[dict, list[dict]]:
    """``run_preflight`` at BUDGET on one rank: its report and every model call's inputs."""
    model = build_model(config_file(tmp_path, family), seed=0, vocab_size=len(VIDEO_TOKENIZER))
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    config = RunConfig(model=ModelSettings(path="m", tokenizer="t"), data=DataSettings(path="d"),
                       batching=OdbConfig(max_tokens=BUDGET, max_patches=max_patches),
                       preflight=PreflightSettings(memory_limit_mb=10**6))
    report = run_preflight(config, LocalBackend(model), SimulatedGroup(1).communicator(0), tokenizer=VIDEO_TOKENIZER,
                           vision=vision_spec(model, SMALL), packed=True, world_size=1, log=lambda _: None)
    return report.to_dict(), calls


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_worst_case_of_a_video_model_holds_the_largest_clips_the_budget_holds(tmp_path, family):
    """Clips of the largest frame the processor makes, the first with as many temporal groups as
    it keeps at that size (Qwen2-VL bounds a frame: all 384 groups of 768 frames; Qwen3-VL a clip:
    one group) and the budget holds; then clips until no clip the processor makes fits the tokens
    left (one kept for text). The model's forward gets exactly that: its videos as image tokens
    (odb's one vision-tower call) laid out as the family's processor lays them out."""
    report, calls = probe(tmp_path, family, max_patches=None)
    sizes = frame_squares(family, 2)
    largest, smallest = sizes[-1], sizes[0]
    groups = 1  # (SMALL: 8 visual tokens a frame at most, so one clip of them fits)
    while groups < 384 and len(clip_ids(family, groups + 1, largest)) <= BUDGET - 1 and \
            frame_squares(family, 2 * groups + 2)[-1] == largest:
        groups += 1
    call = max(calls, key=lambda c: int(c["image_grid_thw"].prod(dim=1).sum()))
    grid = call["image_grid_thw"]
    squares = (grid[:, 1] * grid[:, 2] // MERGE2).tolist()
    assert grid[0].tolist()[0] == groups and squares[0] == largest, grid.tolist()
    assert all(s in sizes for s in squares) and squares == sorted(squares, reverse=True)
    expected = [i for (t, _, _), s in zip(grid.tolist(), squares) for i in clip_ids(family, t, s)]
    ids = call["input_ids"][0]
    assert len(ids) == BUDGET and ids[:len(expected)].tolist() == [IMAGE if i == VIDEO else i for i in expected]
    assert BUDGET - 1 - len(expected) < len(clip_ids(family, 1, smallest))  # no other clip fits
    assert int(call["pixel_values"].shape[0]) == report["max_patches"] == int(grid.prod(dim=1).sum())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_video_worst_case_keeps_to_max_patches(tmp_path, family):
    """With max_patches 100 the worst case is the largest frame the processor makes of at most 100
    patches (a thin one of 25 squares: exactly 100), where the largest images hold 96."""
    report, calls = probe(tmp_path, family, max_patches=100)
    largest = max(s for s in frame_squares(family, 2) if s * MERGE2 <= 100) * MERGE2
    patches = [int(c["image_grid_thw"].prod(dim=1).sum()) for c in calls]
    assert report["max_patches"] == max(patches) == largest == 100, patches
