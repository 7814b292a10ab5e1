"""Labels with any chat template (odb.data.labels) and truncation between turns.

The stock templates of eleven families (tests/fixtures/templates) against hand-written label runs
(Phi-3's eos trailer and DeepSeek-R1's forced ``<think>`` among them; tool calls and reasoning are
tests/unit/test_templates.py's); the bundled template's own ``{% generation %}`` mask as an oracle;
a template that rewrites past turns (Qwen3-like); samples left without labels; cuts that end on a
complete assistant turn.
"""

import functools
import json
from collections import Counter
from itertools import groupby

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from conftest import ROOT, bundled_tokenizer
from odb.cli.show_labels import main as show_labels_main
from odb.data.feed import DataError, SampleFeed
from odb.data.formats import normalize
from odb.data.images import VisionSpec
from odb.data.labels import TemplateMismatch, encode_chat
from odb.data.processing import DataConfig, SampleDataset, sample_sizes

TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
CHATML = ["<|im_start|>", "<|im_end|>"]
FAMILIES = {  # the special tokens each template needs, which the bundled tokenizer lacks
    "qwen2_5": {"additional_special_tokens": CHATML},
    "qwen2_vl": {"additional_special_tokens": CHATML},
    "qwen3_like": {"additional_special_tokens": CHATML + ["<think>", "</think>"]},
    "llama3": {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "bos_token": "<|begin_of_text|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "gemma": {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"], "bos_token": "<bos>"},
    # tests/unit/test_templates.py: tool calling, reasoning, trailers and forced answer prefixes
    "qwen2_5_tools": {"additional_special_tokens": CHATML + ["<tool_call>", "</tool_call>"]},
    "qwen3": {"additional_special_tokens": CHATML + ["<think>", "</think>", "<tool_call>", "</tool_call>",
                                                     "<tool_response>", "</tool_response>"]},
    "llama3_1": {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                               "<|python_tag|>"], "bos_token": "<|begin_of_text|>"},
    "mistral_v0_3": {"additional_special_tokens": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                     "bos_token": "<s>", "eos_token": "</s>"},
    "phi3_mini": {"eos_token": "<|endoftext|>"},  # (the bundled tokenizer has Phi-3's <|user|>, <|end|>, ...)
    "phi3_5_mini": {"eos_token": "<|endoftext|>"},
    "deepseek_r1_distill_qwen": {"additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                                 "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    # tests/unit/test_chat_options.py: a template that raises on a system message
    "gemma2": {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"], "bos_token": "<bos>"},
}


@functools.cache
def family_tokenizer(name: str):
    """A copy of the bundled tokenizer with the family's special tokens and stock template."""
    if name == "bundled":
        return bundled_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizer"))
    tokenizer.add_special_tokens(FAMILIES[name])
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def label_runs(tokenizer, input_ids, labels) -> list[str]:
    """The runs of consecutive labelled tokens, decoded."""
    pairs = zip(input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids,
                labels.tolist() if isinstance(labels, torch.Tensor) else labels)
    return [tokenizer.decode([token for token, _ in run])
            for is_label, run in groupby(pairs, key=lambda pair: pair[1] != -100) if is_label]


def chat_labels(chat) -> list[int]:
    labels = [-100] * len(chat.input_ids)
    for start, end in chat.label_spans:
        labels[start:end] = chat.input_ids[start:end]
    return labels


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    """The oracle: transformers' own rendering and tokenization."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi there!"}]
SECOND = [{"role": "user", "content": "And again?"}, {"role": "assistant", "content": "Second answer."}]
CONVERSATIONS = {"single": [SYSTEM] + FIRST, "multi": [SYSTEM] + FIRST + SECOND, "no-system": FIRST + SECOND}

RUNS = {  # what each family trains on: the answers and their end-of-turn tokens, nothing else
    "bundled": ["Hi there!<|end|>", "Second answer.<|end|>"],
    "qwen2_5": ["Hi there!<|im_end|>", "Second answer.<|im_end|>"],  # not the "\n" after <|im_end|>
    "qwen2_vl": ["Hi there!<|im_end|>", "Second answer.<|im_end|>"],
    "llama3": ["Hi there!<|eot_id|>", "Second answer.<|eot_id|>"],
    "mistral": [" Hi there!</s>", " Second answer.</s>"],  # the model generates the space after [/INST]
    "gemma": ["Hi there!<end_of_turn>", "Second answer.<end_of_turn>"],  # not the "\n" after it
    "qwen2_5_tools": ["Hi there!<|im_end|>", "Second answer.<|im_end|>"],
    "llama3_1": ["Hi there!<|eot_id|>", "Second answer.<|eot_id|>"],
    "phi3_mini": ["Hi there!<|end|>", "Second answer.<|end|>"],  # not the "\n<|endoftext|>" that ends the text
    "phi3_5_mini": ["Hi there!<|end|>", "Second answer.<|end|>"],
    "deepseek_r1_distill_qwen": ["Hi there!<｜end▁of▁sentence｜>", "Second answer.<｜end▁of▁sentence｜>"],
}

TEXT = {  # the multi-turn conversation as each stock template renders it
    "bundled": "<|system|>You are terse.<|end|><|user|>Hello?<|end|><|assistant|>Hi there!<|end|><|user|>And again?"
               "<|end|><|assistant|>Second answer.<|end|>",
    "qwen2_5": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n"
               "<|im_start|>assistant\nHi there!<|im_end|>\n<|im_start|>user\nAnd again?<|im_end|>\n"
               "<|im_start|>assistant\nSecond answer.<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHello?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nHi there!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd again?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nSecond answer.<|eot_id|>",
    "mistral": "<s> [INST] You are terse.\n\nHello? [/INST] Hi there!</s> [INST] And again? [/INST] Second answer.</s>",
    "gemma": "<bos><start_of_turn>user\nYou are terse.\n\nHello?<end_of_turn>\n<start_of_turn>model\n"
             "Hi there!<end_of_turn>\n<start_of_turn>user\nAnd again?<end_of_turn>\n<start_of_turn>model\n"
             "Second answer.<end_of_turn>\n",
}
TEXT["qwen2_vl"] = TEXT["qwen2_5_tools"] = TEXT["qwen2_5"]
TEXT["llama3_1"] = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello?"
    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there!<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nAnd again?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    "Second answer.<|eot_id|>")
TEXT["phi3_mini"] = TEXT["phi3_5_mini"] = (  # eos_token ends a rendering without a generation prompt
    "<|system|>\nYou are terse.<|end|>\n<|user|>\nHello?<|end|>\n<|assistant|>\nHi there!<|end|>\n<|user|>\n"
    "And again?<|end|>\n<|assistant|>\nSecond answer.<|end|>\n<|endoftext|>")
TEXT["deepseek_r1_distill_qwen"] = (  # its generation prompt <｜Assistant｜><think>\n forces the answer's start
    "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hello?<｜Assistant｜>Hi there!<｜end▁of▁sentence｜>"
    "<｜User｜>And again?<｜Assistant｜>Second answer.<｜end▁of▁sentence｜>")


@pytest.mark.parametrize("family", list(RUNS))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_each_stock_template_labels_the_answers_and_their_end_tokens_only(tmp_path, family, conversation):
    tokenizer = family_tokenizer(family)
    messages = CONVERSATIONS[conversation]
    sample = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}]), tokenizer)[0]
    assert "skip" not in sample, sample.get("detail")
    assert sample["input_ids"].tolist() == template_ids(tokenizer, messages)
    expected = RUNS[family][:1] if conversation == "single" else RUNS[family]
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == expected
    if conversation == "multi":
        assert tokenizer.decode(sample["input_ids"]) == TEXT[family]
    assert sample["truncated_tokens"] == 0


def test_the_default_system_prompt_is_never_labelled():
    tokenizer = family_tokenizer("qwen2_5")
    chat = encode_chat(tokenizer, FIRST)
    assert chat.text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                "assistant.<|im_end|>\n<|im_start|>user\nHello?")
    assert label_runs(tokenizer, chat.input_ids, chat_labels(chat)) == ["Hi there!<|im_end|>"]


def test_spans_equal_the_generation_mask_of_the_bundled_template():
    tokenizer = bundled_tokenizer()
    lines = (ROOT / "data" / "chat.jsonl").read_text().splitlines()[:50]
    turns = 0
    for line in lines:
        messages = normalize(json.loads(line)).messages
        oracle = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
        chat = encode_chat(tokenizer, messages)
        assert chat.input_ids == list(oracle["input_ids"])
        mask = [int(label != -100) for label in chat_labels(chat)]
        assert mask == list(oracle["assistant_masks"]) and any(mask)
        turns += len(chat.label_spans)
    assert turns > len(lines)  # multi-turn conversations among them


def test_qwen2_vl_string_content_with_image_tokens_renders_as_the_image_items_do(tmp_path):
    tokenizer = family_tokenizer("qwen2_vl")
    Image.new("RGB", (56, 84), (200, 10, 10)).save(tmp_path / "red.png")
    record = {"images": ["red.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat color?"}]},
        {"role": "assistant", "content": "Red."}]}
    sample = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), tokenizer, vision=VisionSpec())[0]
    pads = "<|image_pad|>" * 6  # 56 x 84: 6 x 4 patches, merged 2 x 2
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                + pads + "<|vision_end|>\nWhat color?<|im_end|>\n<|im_start|>assistant\nRed.<|im_end|>\n")
    assert tokenizer.decode(sample["input_ids"]) == expected
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == ["Red.<|im_end|>"]
    assert sample["image_grid_thw"].tolist() == [[1, 6, 4]] and sample["patches"] == 24
    # the stock template's own image item: one <|image_pad|>, which the processor would expand
    stock = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert stock == expected.replace(pads, "<|image_pad|>")


THINKING = [SYSTEM] + FIRST + [
    {"role": "user", "content": "And again?"},
    {"role": "assistant", "content": "<think>\nI should answer.\n</think>\n\nSecond answer."}]


def test_a_template_that_rewrites_past_turns_names_the_fallbacks():
    tokenizer = family_tokenizer("qwen3_like")
    with pytest.raises(TemplateMismatch, match=r"strips <think>.*train_on .*'last'.*'all'"):
        encode_chat(tokenizer, THINKING)
    last = encode_chat(tokenizer, THINKING, "last")
    assert last.input_ids == template_ids(tokenizer, THINKING)
    assert label_runs(tokenizer, last.input_ids, chat_labels(last)) == [
        "<think>\nI should answer.\n</think>\n\nSecond answer.<|im_end|>"]
    single = encode_chat(tokenizer, [SYSTEM] + FIRST)  # one turn: nothing to rewrite
    assert label_runs(tokenizer, single.input_ids, chat_labels(single)) == [
        "<think>\n\n</think>\n\nHi there!<|im_end|>"]
    every = encode_chat(tokenizer, THINKING, "all")
    assert every.label_spans == [(0, len(every.input_ids))] and every.turn_ends == []


def test_processing_skips_a_rewriting_template_as_template_mismatch_and_strict_stops(tmp_path):
    tokenizer = family_tokenizer("qwen3_like")
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": THINKING}])
    skipped = SampleDataset(path, tokenizer)[0]
    assert skipped["skip"] == "template_mismatch" and "train_on in the data config to 'last'" in skipped["detail"]
    sample = SampleDataset(path, tokenizer, DataConfig(train_on="last"))[0]
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == [
        "<think>\nI should answer.\n</think>\n\nSecond answer.<|im_end|>"]
    feed = SampleFeed(SampleDataset(path, tokenizer, DataConfig(strict=True)), sample_sizes)
    feed.deal([0])
    with pytest.raises(DataError, match=r"d\.jsonl:1: template_mismatch: .*'last'"):
        feed.fetch([0])


def test_train_on_and_truncation_are_validated():
    with pytest.raises(ValueError, match=r"train_on must be one of \('assistant', 'last', 'all'\)"):
        DataConfig(train_on="assistants")
    with pytest.raises(ValueError, match=r"truncation must be one of \('turns', 'tokens'\)"):
        DataConfig(truncation="words")


def exchanges(count: int) -> list[dict[str, str]]:
    words = "apple river stone garden"
    return [m for i in range(1, count + 1) for m in ({"role": "user", "content": f"Question {i}: {words}?"},
                                                       {"role": "assistant", "content": f"Answer {i}: {words}."})]


def test_a_sample_without_label_tokens_is_skipped_as_no_labels(tmp_path):
    tokenizer = bundled_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": exchanges(3)}])
    prompt = len(template_ids(tokenizer, exchanges(3)[:1], add_generation_prompt=True))
    cut = SampleDataset(path, tokenizer, truncate_to=prompt)[0]  # the cap ends where the first answer starts
    assert cut["skip"] == "no_labels" and f"truncation to {prompt} tokens cut every label" in cut["detail"]
    # train_on 'last': a cap before the final answer leaves nothing, where 'assistant' keeps two turns
    before_last = len(template_ids(tokenizer, exchanges(3)[:5], add_generation_prompt=True))
    last = SampleDataset(path, tokenizer, DataConfig(train_on="last"), truncate_to=before_last)[0]
    assert last["skip"] == "no_labels"
    kept = SampleDataset(path, tokenizer, truncate_to=before_last)[0]
    assert len(kept["input_ids"]) == len(template_ids(tokenizer, exchanges(2)))
    silent = AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizer"))  # renders no assistant turn
    silent.chat_template = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}<|end|>{% endif %}" \
                           "{% endfor %}"
    skipped = SampleDataset(path, silent)[0]
    assert skipped["skip"] == "no_labels" and "chat template marks no token" in skipped["detail"]


def turn_bounds(tokenizer, messages, exchange: int, trailing: int) -> tuple[int, int]:
    """Token positions where exchange ``exchange``'s answer starts and where its end-of-turn token
    ends, from transformers' renderings (``trailing``: the template's tokens after that token)."""
    start = len(template_ids(tokenizer, messages[:2 * exchange - 1], add_generation_prompt=True))
    return start, len(template_ids(tokenizer, messages[:2 * exchange])) - trailing


TRUNCATION_FAMILIES = {"bundled": ("<|end|>", 0), "qwen2_5": ("<|im_end|>", 1)}  # end token, tokens after it


@pytest.mark.parametrize("family", list(TRUNCATION_FAMILIES))
def test_turn_truncation_ends_on_a_complete_assistant_turn(tmp_path, family):
    tokenizer = family_tokenizer(family)
    end_token, trailing = TRUNCATION_FAMILIES[family]
    messages = exchanges(10)
    full = template_ids(tokenizer, messages)
    start4, end4 = turn_bounds(tokenizer, messages, 4, trailing)
    _, end3 = turn_bounds(tokenizer, messages, 3, trailing)
    cap = (start4 + end4) // 2  # in the middle of the fourth answer
    assert end3 < start4 < cap < end4
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    turns = SampleDataset(path, tokenizer, truncate_to=cap)[0]
    assert turns["input_ids"].tolist() == full[:end3]
    assert turns["truncated_tokens"] == len(full) - end3
    runs = label_runs(tokenizer, turns["input_ids"], turns["labels"])
    assert runs == [f"Answer {i}: apple river stone garden.{end_token}" for i in (1, 2, 3)]
    tokens = SampleDataset(path, tokenizer, DataConfig(truncation="tokens"), truncate_to=cap)[0]
    assert tokens["input_ids"].tolist() == full[:cap] and tokens["truncated_tokens"] == len(full) - cap
    assert label_runs(tokenizer, tokens["input_ids"], tokens["labels"])[-1].startswith("Answer 4:")
    start1, end1 = turn_bounds(tokenizer, messages, 1, trailing)
    first = SampleDataset(path, tokenizer, truncate_to=end1 - 2)[0]  # the first answer does not fit: a token cut
    assert first["input_ids"].tolist() == full[:end1 - 2] and first["truncated_tokens"] == len(full) - (end1 - 2)
    assert label_runs(tokenizer, first["input_ids"], first["labels"]) == [tokenizer.decode(full[start1:end1 - 2])]
    whole = SampleDataset(path, tokenizer, truncate_to=len(full))[0]
    assert whole["input_ids"].tolist() == full and whole["truncated_tokens"] == 0


def test_the_feed_counts_truncated_samples_and_tokens(tmp_path):
    tokenizer = bundled_tokenizer()
    records = [exchanges(6), exchanges(1), exchanges(5), exchanges(2)]
    three = len(template_ids(tokenizer, exchanges(3)))
    cap = three + 4  # three exchanges fit, four do not
    kept = [min(len(template_ids(tokenizer, r)), three) for r in records]
    cut = [len(template_ids(tokenizer, r)) - k for r, k in zip(records, kept)]
    dataset = SampleDataset(write_jsonl(tmp_path / "d.jsonl", [{"messages": r} for r in records]), tokenizer,
                            truncate_to=cap)
    feed = SampleFeed(dataset, sample_sizes, num_workers=0)
    feed.deal([0, 1, 2, 3])
    costs = feed.fetch([0, 1, 2, 3])
    assert [sizes.tokens for sizes in costs] == kept
    assert feed.truncated == Counter(samples=2, tokens=cut[0] + cut[2]) and cut[0] > cut[2] > 0
    feed.restore([0, 2])  # a resumed window: counted when first fetched
    assert feed.truncated == Counter(samples=2, tokens=cut[0] + cut[2])


def image_record(with_images: tuple[bool, bool], exchanges_kept: int = 2) -> dict:
    """Two exchanges; ``with_images`` says which user turn shows an image (a.png, then b.png)."""
    paths = [p for p, shown in zip(["a.png", "b.png"], with_images) if shown]
    turns = [{"from": "human", "value": ("<image>" if with_images[0] else "") + "first question"},
             {"from": "gpt", "value": "one answer"},
             {"from": "human", "value": ("<image>" if with_images[1] else "") + "second question"},
             {"from": "gpt", "value": "two answer"}][:2 * exchanges_kept]
    return {"images": paths[:sum(with_images[:exchanges_kept])], "conversations": turns}


@pytest.mark.parametrize("with_images", [(True, True), (False, True)], ids=["both", "second-only"])
def test_turn_truncation_drops_the_images_of_the_turns_it_drops(tmp_path, with_images):
    tokenizer = bundled_tokenizer()
    Image.new("RGB", (56, 56), (200, 10, 10)).save(tmp_path / "a.png")  # 4 x 4 patches, 4 visual tokens
    Image.new("RGB", (112, 56), (10, 200, 10)).save(tmp_path / "b.png")  # 4 x 8 patches, 8 visual tokens
    path = write_jsonl(tmp_path / "d.jsonl", [image_record(with_images), image_record(with_images, 1)])
    dataset = SampleDataset(path, tokenizer, vision=VisionSpec())
    full, alone = dataset[0], dataset[1]  # alone: the record cut by hand to its first exchange
    cap = len(alone["input_ids"]) + 3  # inside the second exchange, before its image ends
    cut = SampleDataset(path, tokenizer, vision=VisionSpec(), truncate_to=cap)[0]
    assert cut["truncated_tokens"] == len(full["input_ids"]) - len(alone["input_ids"])
    for key in ("input_ids", "labels"):
        assert torch.equal(cut[key], alone[key]), key
    for key in ("pixel_values", "image_grid_thw"):
        assert (key in cut) == (key in alone) == with_images[0], key
        if with_images[0]:
            assert torch.equal(cut[key], alone[key]), key
    assert cut["patches"] == alone["patches"] == (16 if with_images[0] else 0)
    tokens = SampleDataset(path, tokenizer, DataConfig(truncation="tokens"), vision=VisionSpec(), truncate_to=cap)[0]
    assert tokens["skip"] == "over_cap" and "would cut an image" in tokens["detail"]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3", "mistral", "gemma", "phi3_mini", "deepseek_r1_distill_qwen"])
def test_show_labels_prints_what_a_run_would_train_on(tmp_path, family, capsys):
    folder = tmp_path / "tokenizer"
    family_tokenizer(family).save_pretrained(folder)
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS["multi"]}])
    show_labels_main(["--tokenizer", str(folder), "--data", str(data)])
    out = capsys.readouterr().out
    assert [line.split("label run: ", 1)[1] for line in out.splitlines() if "label run: " in line] == \
        [repr(run) for run in RUNS[family]]
