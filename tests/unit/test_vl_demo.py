"""The bundled vision-language demo (configs/tiny_vl_model.json on data/mm/train.jsonl, the README's
command): its default tokenizer is its own, with a video token, and every record, text, image or
video, becomes a sample as the run makes them (no launch: the run's flags, datasets and processing
in this process)."""

import json
import math

import av

from conftest import ROOT, bundled_tokenizer, train_defaults
from odb.training.launch.flags import parse_config
from odb.training.model.build import build_model, load_tokenizer, vision_spec
from odb.training.run.datasets import build_datasets

VL = ROOT / "configs" / "tiny_vl_model.json"
MM = ROOT / "data" / "mm" / "train.jsonl"


def demo_config(tmp_path, *flags: str):
    return parse_config(["--model", str(VL), "--data", str(MM), "--output_dir", str(tmp_path / "out"), *flags],
                        defaults=train_defaults())


def test_the_vl_demo_reads_its_own_tokenizer_and_the_text_demo_the_text_one(tmp_path):
    assert demo_config(tmp_path).model.tokenizer == str(ROOT / "data" / "vl_tokenizer")
    text = parse_config(["--output_dir", str(tmp_path / "out")], defaults=train_defaults())
    assert text.model.tokenizer == str(ROOT / "data" / "tokenizer")
    assert demo_config(tmp_path, "--tokenizer", str(ROOT / "data" / "tokenizer")).model.tokenizer == \
        str(ROOT / "data" / "tokenizer")  # (a flag wins)


def test_the_vl_tokenizer_is_the_text_one_plus_the_models_video_token():
    text, vl = bundled_tokenizer(), load_tokenizer(ROOT / "data" / "vl_tokenizer")
    settings = json.loads(VL.read_text())
    assert len(vl) == len(text) + 1 <= settings["text_config"]["vocab_size"]
    assert vl.convert_tokens_to_ids("<|video_pad|>") == settings["video_token_id"] == len(text)
    assert vl.convert_tokens_to_ids("<|image_pad|>") == settings["image_token_id"] == text.convert_tokens_to_ids(
        "<|image_pad|>")
    rows = [json.loads(line) for line in MM.read_text().splitlines()]
    for row in rows:
        said = "".join(turn["value"] for turn in row["conversations"])
        assert vl(said)["input_ids"] == text(said)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert vl.apply_chat_template(messages, tokenize=False) == text.apply_chat_template(messages, tokenize=False)


def groups_of(clip) -> int:
    """The temporal groups of a clip sampled at 2 frames a second (at least 4 frames, in pairs), from
    the file itself."""
    with av.open(str(MM.parent / clip)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(video=0))
        sampled = frames / float(stream.average_rate) * 2
    return max(4, math.floor(sampled / 2) * 2) // 2


def test_every_record_of_the_vl_demo_becomes_a_sample_videos_included(tmp_path):
    """The run's own datasets: nothing skipped; a video record's sample holds one video of the
    clip's temporal groups, one video token per merged patch and none labelled; an image record's
    its image; a text record's neither."""
    config = demo_config(tmp_path)
    tokenizer = load_tokenizer(config.model.tokenizer)
    model = build_model(VL, seed=0, vocab_size=len(tokenizer))
    vision = vision_spec(model, config.data.processing, VL)
    train, _ = build_datasets(config, tokenizer, vision, truncate_to=config.batching.max_tokens)
    rows = [json.loads(line) for line in MM.read_text().splitlines()]
    assert len(train) == len(rows)
    video_id, image_id = model.config.video_token_id, model.config.image_token_id
    kinds = {"video": 0, "image": 0, "text": 0}
    for index, row in enumerate(rows):
        sample = train[index]
        assert "skip" not in sample, sample
        ids, labels = sample["input_ids"], sample["labels"]
        videos, images = int((ids == video_id).sum()), int((ids == image_id).sum())
        assert int((labels != -100).sum()) > 0 and not bool(((labels == video_id) | (labels == image_id)).any())
        if "video" in row:
            kinds["video"] += 1
            grid = sample["video_grid_thw"]
            assert grid.shape == (1, 3) and int(grid[0, 0]) == groups_of(row["video"])
            assert videos == int(grid.prod()) // 4 > 0 and images == 0 and "image_grid_thw" not in sample
            assert int(sample["patches"]) == int(grid.prod())
        elif "image" in row:
            kinds["image"] += 1
            assert images == int(sample["image_grid_thw"].prod()) // 4 > 0 and videos == 0
        else:
            kinds["text"] += 1
            assert videos == images == 0 and int(sample["patches"]) == 0
    assert kinds == {"video": 24, "image": 300, "text": 24}
