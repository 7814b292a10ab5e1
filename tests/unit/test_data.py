"""Data: formats, sources, processing in workers, images, skip/strict, exact costs."""

import json
import re
from collections import Counter

import pytest
import torch
from PIL import Image

from bad_records import BAD, bad_data
from conftest import bundled_tokenizer, check_caps
from launch import ROOT
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import run_ranks
from odb.data.feed import DataError, SampleFeed
from odb.data.processing import DataConfig, SampleDataset, load_data_config, sample_sizes
from odb.training.model.build import build_model, vision_spec

TOKENIZER = bundled_tokenizer()
VL = ROOT / "configs" / "tiny_vl_model.json"
IMAGE_PAD = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def layout(sample):
    """(token, is_label) pairs: the hand-checkable view of a processed sample."""
    tokens = TOKENIZER.convert_ids_to_tokens(sample["input_ids"].tolist())
    return [(t, int(label) != -100) for t, label in zip(tokens, sample["labels"].tolist())]


EXPECTED_TEXT = [("<|system|>", False), ("Hello", False), ("<|end|>", False), ("<|user|>", False),
                 ("apple", False), ("Ġriver", False), ("<|end|>", False), ("<|assistant|>", False),
                 ("Hello", True), ("<|end|>", True)]


@pytest.mark.parametrize("record", [
    {"messages": [{"role": "system", "content": "Hello"}, {"role": "user", "content": "apple river"},
                  {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "system", "content": "Hello"},
                  {"role": "user", "content": [{"type": "text", "text": "apple river"}]},
                  {"role": "assistant", "content": "Hello"}]},
    {"conversations": [{"from": "system", "value": "Hello"}, {"from": "human", "value": "apple river"},
                       {"from": "gpt", "value": "Hello"}]},
], ids=["messages", "messages-parts", "sharegpt"])
def test_text_formats_give_the_hand_checked_layout(tmp_path, record):
    dataset = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), TOKENIZER)
    assert layout(dataset[0]) == EXPECTED_TEXT  # labels on the assistant turn and its end only


def test_llava_record_expands_the_image_into_its_visual_tokens(tmp_path):
    Image.new("RGB", (56, 84), (200, 10, 10)).save(tmp_path / "red.png")
    record = {"image": "red.png", "conversations": [{"from": "human", "value": "<image>\napple"},
                                                     {"from": "gpt", "value": "Hello"}]}
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER))
    dataset = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), TOKENIZER,
                            vision=vision_spec(model, DataConfig()))
    sample = dataset[0]
    # 56 wide x 84 high, 14-pixel patches: 6 rows x 4 columns (1 frame) = 24 patches; 2 x 2 merged: 6 tokens
    assert sample["image_grid_thw"].tolist() == [[1, 6, 4]] and sample["patches"] == 24
    assert sample["pixel_values"].shape == (24, 3 * 2 * 14 * 14)
    assert layout(sample) == [("<|user|>", False), ("<|vision_start|>", False)] + [("<|image_pad|>", False)] * 6 + [
        ("<|vision_end|>", False), ("Ċ", False), ("apple", False), ("<|end|>", False), ("<|assistant|>", False),
        ("Hello", True), ("<|end|>", True)]
    assert sample_sizes(sample) == (len(sample["input_ids"]), 2, 24, None, 0)  # (one sequence: no second)


TAG = ["<", "i", "m", "a", "ge", ">"]  # a literal "<image>" as text


@pytest.mark.parametrize("model", ["text", "vl"])
@pytest.mark.parametrize("record", [
    {"messages": [{"role": "user", "content": "apple <image>"}, {"role": "assistant", "content": "Hello <image>"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "apple <image>"}]},
                  {"role": "assistant", "content": "Hello <image>"}]},
    {"conversations": [{"from": "human", "value": "apple <image>"}, {"from": "gpt", "value": "Hello <image>"}]},
], ids=["messages", "messages-parts", "sharegpt"])
def test_a_literal_image_tag_in_a_record_without_images_is_text(tmp_path, record, model):
    vision = vision_spec(build_model(VL, seed=0, vocab_size=len(TOKENIZER)), DataConfig()) if model == "vl" else None
    dataset = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), TOKENIZER, vision=vision)
    assert layout(dataset[0]) == ([("<|user|>", False), ("apple", False), ("Ġ", False)] + [(t, False) for t in TAG]
                                  + [("<|end|>", False), ("<|assistant|>", False), ("Hello", True), ("Ġ", True)]
                                  + [(t, True) for t in TAG] + [("<|end|>", True)])


IMAGE_RECORDS = [  # the same two-image chat: red.png (56 x 84), then blue.png (56 x 56)
    {"images": ["red.png", "blue.png"], "conversations": [{"from": "human", "value": "<image>apple<image>"},
                                                          {"from": "gpt", "value": "Hello"}]},
    {"images": ["red.png", "blue.png"],  # TRL / Hugging Face: the parts carry no path
     "messages": [{"role": "user",
                   "content": [{"type": "image"}, {"type": "text", "text": "apple"}, {"type": "image"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]},
    {"images": ["red.png", "blue.png"],  # as Parquet gives it back: Arrow fills every part's fields
     "messages": [{"role": "user", "content": [{"type": "image", "image": None, "text": None},
                                               {"type": "text", "image": None, "text": "apple"},
                                               {"type": "image", "image": None, "text": None}]},
                  {"role": "assistant", "content": "Hello"}]},
    {"images": ["red.png", "blue.png"], "messages": [{"role": "user", "content": "<image>apple<image>"},
                                                     {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "apple"},
                                               {"type": "image", "image": "blue.png"}]},
                  {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "red.png"}},
                                               {"type": "text", "text": "apple"},
                                               {"type": "image_url", "image_url": {"url": "blue.png"}}]},
                  {"role": "assistant", "content": "Hello"}]},
]


def image_files(tmp_path):
    Image.new("RGB", (56, 84), (200, 10, 10)).save(tmp_path / "red.png")
    Image.new("RGB", (56, 56), (10, 10, 200)).save(tmp_path / "blue.png")


@pytest.mark.parametrize("record", IMAGE_RECORDS[1:], ids=["trl", "trl-parquet", "messages-placeholders",
                                                           "messages-image-paths", "messages-image-urls"])
def test_every_image_record_style_gives_the_llava_sample(tmp_path, record):
    image_files(tmp_path)
    vision = vision_spec(build_model(VL, seed=0, vocab_size=len(TOKENIZER)), DataConfig())
    dataset = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [IMAGE_RECORDS[0], record]), TOKENIZER, vision=vision)
    llava, sample = dataset[0], dataset[1]
    # 56 x 84: 6 x 4 patches, 6 visual tokens; 56 x 56: 4 x 4 patches, 4 visual tokens
    assert llava["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 4]] and llava["patches"] == 40
    assert layout(llava) == ([("<|user|>", False), ("<|vision_start|>", False)] + [("<|image_pad|>", False)] * 6
                             + [("<|vision_end|>", False), ("apple", False), ("<|vision_start|>", False)]
                             + [("<|image_pad|>", False)] * 4
                             + [("<|vision_end|>", False), ("<|end|>", False), ("<|assistant|>", False),
                                ("Hello", True), ("<|end|>", True)])
    for key in ("input_ids", "labels", "pixel_values", "image_grid_thw"):
        assert torch.equal(sample[key], llava[key]), key
    assert sample["patches"] == llava["patches"]


def image_part(path=None):
    return {"type": "image"} if path is None else {"type": "image", "image": path}


def chat(content, **extra):
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Hello"}], **extra}


@pytest.mark.parametrize("record, reason", [
    (chat([image_part("red.png"), image_part()], images=["blue.png"]), "mixed_image_sources"),
    (chat([image_part("red.png")], images=["red.png"]), "mixed_image_sources"),
    (chat([image_part(), {"type": "text", "text": "apple"}]), "image_placeholder_mismatch"),
    (chat([image_part(), image_part()], images=["red.png"]), "image_placeholder_mismatch"),
    (chat("<image> apple <image>", images=["red.png"]), "image_placeholder_mismatch"),
    (chat(5), "bad_content"),
    (chat({"text": "apple"}), "bad_content"),
    (chat([{"type": "text", "text": 5}]), "bad_content"),
    (chat([{"type": "audio", "audio": "a.wav"}]), "bad_content"),
    (chat([image_part(5)]), "bad_content"),
    (chat("<image> apple", images=[5]), "bad_content"),
    ({"image": {"path": "red.png"}, "conversations": [{"from": "human", "value": "<image>"},
                                                      {"from": "gpt", "value": "b"}]}, "bad_content"),
], ids=["parts-and-list", "parts-and-same-list", "no-path-no-list", "two-parts-one-image", "two-tags-one-image",
        "int-content", "dict-content", "int-text-part", "unknown-part", "int-image-part", "int-image-list",
        "dict-image"])
def test_records_whose_images_do_not_add_up_are_skipped_with_a_clear_reason(tmp_path, record, reason):
    image_files(tmp_path)
    vision = vision_spec(build_model(VL, seed=0, vocab_size=len(TOKENIZER)), DataConfig())
    sample = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), TOKENIZER, vision=vision)[0]
    assert sample.get("skip") == reason, sample.get("detail", sample.keys())


@pytest.mark.parametrize("record", IMAGE_RECORDS + [chat("apple", image="red.png")],
                         ids=["llava", "trl", "trl-parquet", "messages-placeholders", "messages-image-paths",
                              "messages-image-urls", "one-image-no-placeholder"])
def test_a_text_model_skips_records_with_images_and_strict_stops(tmp_path, record):
    image_files(tmp_path)
    path = write_jsonl(tmp_path / "d.jsonl", [record])
    skipped = SampleDataset(path, TOKENIZER)[0]  # vision=None: a text model (model.build.vision_spec)
    assert skipped.get("skip") == "image_for_text_model", skipped.get("detail", skipped.keys())
    assert "vision-language model (e.g. Qwen2-VL) or drop the images" in skipped["detail"]
    feed = SampleFeed(SampleDataset(path, TOKENIZER, DataConfig(strict=True)), sample_sizes, num_workers=0)
    feed.deal([0])
    with pytest.raises(DataError, match=r"d\.jsonl:1: image_for_text_model: [12] image\(s\) for a text-only model"):
        feed.fetch([0])


STRAY = "<|image_pad|>"  # the model's image token, written in a record's text


@pytest.mark.parametrize("record, found, expected", [
    (chat(f"What is {STRAY}?"), 1, 0),
    (chat(f"<image>What is {STRAY}?", images=["red.png"]), 7, 6),  # red.png: 6 visual tokens, and one more
    ({"messages": [{"role": "user", "content": "apple"}, {"role": "assistant", "content": f"It is {STRAY}{STRAY}"}]},
     2, 0),
], ids=["no-image", "image-and-literal", "in-the-answer"])
def test_a_literal_image_token_is_that_record_s_skip_reason_and_strict_names_it(tmp_path, record, found, expected):
    """Unchecked, the sample reaches the model with more image tokens than image features, and the
    forward stops at the M-RoPE step on every rank."""
    image_files(tmp_path)
    vision = vision_spec(build_model(VL, seed=0, vocab_size=len(TOKENIZER)), DataConfig())
    good = chat("apple")
    path = write_jsonl(tmp_path / "d.jsonl", [record, good])
    feed = SampleFeed(SampleDataset(path, TOKENIZER, vision=vision), sample_sizes, num_workers=0)
    feed.deal([0, 1])
    costs = feed.fetch([0, 1])
    assert costs[0] is None and costs[1] is not None
    assert feed.skipped == Counter(image_token_mismatch=1)
    detail = (f"{found} image token(s) '<|image_pad|>' in the tokenized sample but its {int(expected > 0)} image(s) "
              f"make {expected}")
    assert detail in feed.examples[0] and "remove it, or write images as <image> placeholders" in feed.examples[0]
    strict = SampleFeed(SampleDataset(path, TOKENIZER, DataConfig(strict=True), vision=vision), sample_sizes,
                        num_workers=0)
    strict.deal([0])
    with pytest.raises(DataError, match=r"d\.jsonl:1: image_token_mismatch: " + re.escape(detail)):
        strict.fetch([0])
    if not expected:  # a text model reads the token as text
        assert "skip" not in SampleDataset(path, TOKENIZER)[0]


def test_a_video_token_in_a_record_s_text_is_skipped_too(tmp_path):
    from transformers import AutoTokenizer

    from odb.data.images import VisionSpec

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizer"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|video_pad|>"]})
    video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    spec = VisionSpec(image_token_id=7, vision_start_token_id=5, vision_end_token_id=6, video_token_id=video)
    path = write_jsonl(tmp_path / "d.jsonl", [chat("What is <|video_pad|>?"), chat("apple")])
    dataset = SampleDataset(path, tokenizer, vision=spec)
    assert dataset[0]["skip"] == "image_token_mismatch" and "1 video token(s)" in dataset[0]["detail"]
    assert "skip" not in dataset[1]


def test_format_is_detected_per_record_and_can_be_forced(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    auto = SampleDataset(path, TOKENIZER)
    assert layout(auto[0]) == layout(auto[1])
    forced = SampleDataset(path, TOKENIZER, DataConfig(format="sharegpt"))
    assert forced[0]["skip"] == "no_messages" and "skip" not in forced[1]


def test_json_parquet_and_folders_are_sources(tmp_path):
    from datasets import Dataset

    rows = [{"messages": [{"role": "user", "content": f"apple {i}"}, {"role": "assistant", "content": "Hello"}]}
            for i in range(5)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.json").write_text(json.dumps(rows[:2]))
    Dataset.from_list(rows[2:]).to_parquet(str(tmp_path / "a" / "two.parquet"))
    dataset = SampleDataset(tmp_path / "a", TOKENIZER)
    assert len(dataset) == 5
    assert [layout(dataset[i]) for i in range(5)] == [layout(SampleDataset(
        write_jsonl(tmp_path / f"r{i}.jsonl", [rows[i]]), TOKENIZER)[0]) for i in range(5)]


def test_labels_on_all_text_when_asked():
    dataset = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, DataConfig(train_on="all"), max_samples=3)
    sample = dataset[0]
    assert bool((sample["labels"] == sample["input_ids"]).all())


def test_augmentation_makes_lengths_known_only_after_processing_and_is_deterministic():
    config = DataConfig(system_prompts=("Be brief.", "You are a very careful and precise assistant."),
                        system_prompt_prob=0.7, turn_sampling=True)
    dataset = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, config, max_samples=200)
    size = len(dataset)
    epoch0 = [len(dataset[i]["input_ids"]) for i in range(size)]
    epoch1 = [len(dataset[size + i]["input_ids"]) for i in range(size)]
    assert epoch0 != epoch1  # the same records, other lengths in another epoch
    assert epoch0 == [len(dataset[i]["input_ids"]) for i in range(size)]  # same uid, same sample


def test_bad_records_are_skipped_and_counted_by_reason(tmp_path):
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER))
    dataset = SampleDataset(bad_data(tmp_path), TOKENIZER, vision=vision_spec(model, DataConfig()),
                            truncate_to=64)
    feed = SampleFeed(dataset, sample_sizes, num_workers=1)
    uids = list(range(len(dataset)))
    feed.deal(uids)
    costs = feed.fetch(uids)
    assert [c is None for c in costs] == [False] + [True] * len(BAD) + [False]
    assert feed.skipped == Counter(reason for _, reason in BAD)
    assert feed.examples[0].startswith(f"{tmp_path / 'bad.jsonl'}:2: not_json")
    feed.close()


def test_strict_stops_with_file_line_and_reason(tmp_path):
    dataset = SampleDataset(bad_data(tmp_path), TOKENIZER, DataConfig(strict=True))
    feed = SampleFeed(dataset, sample_sizes, num_workers=0)
    feed.deal([0, 1])
    with pytest.raises(DataError, match=r"bad.jsonl:2: not_json .*without --strict"):
        feed.fetch([0, 1])


def test_no_micro_batch_exceeds_the_token_or_patch_cap_and_costs_are_what_the_model_gets():
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER))
    config = DataConfig(max_pixels=112 * 112 * 4)
    dataset = SampleDataset(ROOT / "data" / "mm" / "train.jsonl", TOKENIZER, config, vision=vision_spec(model, config),
                            truncate_to=512)
    odb = OdbConfig(max_tokens=512, max_patches=600, window=32, sharding="static")
    feed = SampleFeed(dataset, sample_sizes, num_workers=1)
    steps = run_ranks(1, lambda comm: list(OnlineBatcher(odb, comm, dataset_size=len(dataset), feed=feed)))
    check_caps(steps, max_tokens=512, max_patches=600)
    micro = [m for s in steps[0] for m in s.micro_batches]
    assert sum(len(m.samples) for m in micro) + sum(feed.skipped.values()) == len(dataset)
    for m in micro:
        for cost in m.samples:
            sample = feed.take(cost.uid)
            visual = int((sample["input_ids"] == IMAGE_PAD).sum())
            grid = sample.get("image_grid_thw")  # (none: a text record)
            assert visual == (int(grid.prod(dim=1).sum()) // 4 if grid is not None else 0)  # merge 2 x 2
            assert (cost.tokens, cost.patches) == (len(sample["input_ids"]), sample["patches"])
    feed.close()


def test_data_config_is_strict_about_keys(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"formt": "llava"}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['formt'\]"):
        load_data_config(path)
    assert load_data_config(ROOT / "configs" / "data.json").format == "auto"


def test_packed_multimodal_rows_equal_each_sample_alone():
    from odb.data.collate import collate_packed
    from odb.training.model.mrope import packed_position_ids

    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER)).eval()
    dataset = SampleDataset(ROOT / "data" / "mm" / "train.jsonl", TOKENIZER, vision=vision_spec(model, DataConfig()))
    samples = [dataset[i] for i in range(4)]
    batch = collate_packed(samples)
    cu = batch["cu_seq_lens_q"]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"], use_cache=False,
                       position_ids=packed_position_ids(model, batch["input_ids"], cu, batch["image_grid_thw"])).logits
        bounds = cu.tolist()
        for sample, start, end in zip(samples, bounds, bounds[1:]):
            ids = sample["input_ids"][None]
            alone = model(input_ids=ids, pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"],
                          mm_token_type_ids=(ids == IMAGE_PAD).int(), use_cache=False).logits[0]
            assert torch.allclose(packed[0, start:end], alone, atol=1e-5, rtol=1e-5)


def test_turn_sampling_drops_the_images_of_the_turns_it_leaves_out(tmp_path):
    """Two exchanges, one image each (different sizes): a sample cut to the first exchange holds
    the first image only; its visual tokens match its grids."""
    Image.new("RGB", (56, 56), (200, 10, 10)).save(tmp_path / "a.png")
    Image.new("RGB", (112, 56), (10, 200, 10)).save(tmp_path / "b.png")
    record = {"images": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "<image> first"}, {"from": "gpt", "value": "one"},
        {"from": "human", "value": "<image> second"}, {"from": "gpt", "value": "two"}]}
    model = build_model(VL, seed=0, vocab_size=len(TOKENIZER))
    dataset = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), TOKENIZER, DataConfig(turn_sampling=True),
                            vision=vision_spec(model, DataConfig()))
    grids_seen = set()
    for uid in range(12):  # each uid draws its own cut
        sample = dataset[uid]
        visual_tokens = int((sample["input_ids"] == IMAGE_PAD).sum())
        assert visual_tokens == int(sample["image_grid_thw"].prod(dim=1).sum()) // 4 == sample["patches"] // 4
        assert len(sample["pixel_values"]) == sample["patches"]
        grids_seen.add(tuple(map(tuple, sample["image_grid_thw"].tolist())))
    assert grids_seen == {((1, 4, 4),), ((1, 4, 4), (1, 4, 8))}  # both cuts were drawn


def test_a_dataset_over_chosen_indices_gives_those_records_in_that_order(tmp_path):
    full = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER)
    chosen = SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, indices=[3, 0, 5])
    assert len(chosen) == 3
    assert len({tuple(full[i]["input_ids"].tolist()) for i in (3, 0, 5)}) == 3  # three different records
    for position, record in enumerate([3, 0, 5]):
        sample, expected = chosen[position], full[record]
        assert sample["index"] == position and sample["uid"] == position
        assert torch.equal(sample["input_ids"], expected["input_ids"]) and torch.equal(sample["labels"],
                                                                                       expected["labels"])
    assert torch.equal(chosen[4]["input_ids"], full[0]["input_ids"])  # uid 4: the next epoch's position 1
    assert len(SampleDataset(ROOT / "data" / "chat.jsonl", TOKENIZER, indices=[3, 0, 5], max_samples=2)) == 2
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    path = tmp_path / "d.jsonl"
    path.write_text(f"{good}\n\nnot json {{\n{good}\n")  # records: line 1, line 3 (bad), line 4
    picked = SampleDataset(path, TOKENIZER, indices=[1, 0])
    assert (picked[0]["skip"], picked[0]["where"], picked[0]["index"]) == ("not_json", f"{path}:3", 0)
    assert "skip" not in picked[1] and picked[1]["index"] == 1
    with pytest.raises(ValueError, match=r"in \[0, 3\) .*\[3\] outside"):
        SampleDataset(path, TOKENIZER, indices=[0, 3])
