"""tools/make/make_video_trace.py's stated distribution and tools/bench/bench_video.py's records of it."""

import pytest

from tools.bench import bench_video
from tools.make import make_video_trace


def test_the_trace_follows_its_stated_distribution():
    rows = make_video_trace.trace(4000, seed=1)
    shares = {kind: sum(1 for k, _, _ in rows if k == kind) / len(rows) for kind, _ in make_video_trace.SHARES}
    assert all(abs(shares[kind] - share) < 0.03 for kind, share in make_video_trace.SHARES), shares
    for kind, tokens, patches in rows:
        visual = patches // 4
        assert patches % 4 == 0 and tokens > visual  # 4 patches per visual token, and some text
        if kind == "text":
            assert patches == 0 and 30 <= tokens <= 8000
        elif kind == "image":
            assert 64 <= visual <= 1024
        else:  # 2..32 groups of two frames, 12 x 21 visual tokens each
            groups, rest = divmod(visual, make_video_trace.FRAME_TOKENS)
            assert rest == 0 and 2 <= groups <= 32
    assert make_video_trace.trace(50, seed=3) == make_video_trace.trace(50, seed=3)  # seeded


@pytest.mark.parametrize("kind, tokens, patches", [("text", 900, 0), ("image", 700, 2400),
                                                   ("video", 8100, 32256), ("video", 130, 4 * 2 * 252)])
def test_records_keep_the_traces_lengths_divided_by_the_scale(kind, tokens, patches):
    text, groups, side = bench_video.media_sizes(kind, tokens, patches, 8)
    visual = groups * side * side
    assert text == max(4, (tokens - patches // 4) // 8)
    if kind == "text":
        assert groups == side == 0
    else:  # within a rounding of the square side
        want = max(4, patches // 4 // 8)
        assert abs(visual - want) <= groups * (2 * side + 1), (visual, want)
        assert (groups == 1) == (kind == "image") and groups <= 32
