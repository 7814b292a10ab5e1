"""Records that a run must skip, each with the reason it is counted under (shared by the data
tests in tests/unit/test_data.py and the training runs over them in tests/e2e/test_data_launch.py)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

BAD = [
    ("not json {", "not_json"),
    ({"text": "no conversation"}, "no_messages"),
    ({"messages": [{"role": "user", "content": "apple"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "b"}]}, "empty_content"),
    ({"image": "missing.png", "conversations": [{"from": "human", "value": "<image>a"},
                                                {"from": "gpt", "value": "b"}]}, "missing_image"),
    ({"image": "broken.png", "conversations": [{"from": "human", "value": "<image>a"},
                                               {"from": "gpt", "value": "b"}]}, "unreadable_image"),
    ({"image": "big.png", "conversations": [{"from": "human", "value": "apple " * 40 + "<image>"},
                                            {"from": "gpt", "value": "b"}]}, "over_cap"),
    ({"images": ["big.png"], "messages": [{"role": "user", "content": [{"type": "image", "image": "big.png"}]},
                                          {"role": "assistant", "content": "b"}]}, "mixed_image_sources"),
]


def bad_data(tmp_path: Path) -> Path:
    """bad.jsonl in ``tmp_path``: a good record, every BAD one, a good one (with the images they name)."""
    (tmp_path / "broken.png").write_bytes(b"not a png")
    Image.new("RGB", (448, 448)).save(tmp_path / "big.png")
    good = {"messages": [{"role": "user", "content": "apple"}, {"role": "assistant", "content": "Hello"}]}
    rows = [good] + [row for row, _ in BAD] + [good]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
