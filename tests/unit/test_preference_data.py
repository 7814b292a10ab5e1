"""Preference records -> pair samples (odb.data.preference, SampleDataset(pairs=True)).

The oracles: each template's own ``apply_chat_template(prompt + answer, tokenize=True)`` for a
sequence's tokens, and its rendering of the prompt with ``add_generation_prompt=True`` for where the
labels start (they run through the answer's end-of-turn token, found by its id); Gemma 3's template,
which folds a system message itself, for ``system_message`` 'fold'; truncation sizes worked out by
hand from the bundled tokenizer's counts (one token a word of the bundled vocabulary); for images,
the stock Qwen2-VL template's rendering with its image pad expanded; for videos, the model's own
forward on each sequence and each side alone as an SFT sample of its final turn.
"""

import dataclasses
import json
from collections import Counter

import pytest
import torch
from PIL import Image
from test_labels import family_tokenizer, label_runs, template_ids, write_jsonl
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from conftest import ROOT, tool_module
from odb.data.config import DataConfig
from odb.data.formats import SKIP_REASONS
from odb.data.images import VisionSpec
from odb.data.preference import pair_answer_tokens, pair_sequences, split_pair
from odb.data.processing import SampleDataset, sample_sizes
from odb.training.model.build import vision_spec
from video_data import RECORDS, SMALL, VIDEO_TOKENIZER, config_dict, media, model_inputs

QUESTION = "Sort these numbers: 3 1 2"
CHOSEN, REJECTED = "1 2 3", "I cannot do that, I am sorry."
SYSTEM = {"role": "system", "content": "You are terse."}
HISTORY = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help you today?"}]
USER = {"role": "user", "content": QUESTION}


def answer(text):
    return [{"role": "assistant", "content": text}]


FORMATS = {  # record, and the prompt it holds (as messages)
    "a": ({"prompt": QUESTION, "chosen": CHOSEN, "rejected": REJECTED}, [USER]),
    "b": ({"prompt": HISTORY + [USER], "chosen": answer(CHOSEN), "rejected": answer(REJECTED)}, HISTORY + [USER]),
    "c": ({"prompt": QUESTION, "chosen": [USER] + answer(CHOSEN), "rejected": [USER] + answer(REJECTED)}, [USER]),
    "c_history": ({"prompt": QUESTION, "chosen": HISTORY + [USER] + answer(CHOSEN),
                   "rejected": HISTORY + [USER] + answer(REJECTED)}, HISTORY + [USER]),
    "d": ({"chosen": [SYSTEM, USER] + answer(CHOSEN), "rejected": [SYSTEM, USER] + answer(REJECTED)}, [SYSTEM, USER]),
    "e_messages": ({"messages": HISTORY + [USER], "system": SYSTEM["content"], "chosen": CHOSEN, "rejected": REJECTED},
                   [SYSTEM] + HISTORY + [USER]),
    "e_sharegpt": ({"conversations": [{"from": "human", "value": QUESTION}], "chosen": {"from": "gpt", "value": CHOSEN},
                    "rejected": [{"from": "gpt", "value": REJECTED}]}, [USER]),
    "e_system_turn": ({"conversations": [{"from": "system", "value": SYSTEM["content"]},
                                         {"from": "human", "value": QUESTION}],
                       "chosen": CHOSEN, "rejected": REJECTED}, [SYSTEM, USER]),
}
END_OF_TURN = {"bundled": "<|end|>", "qwen2_5": "<|im_end|>"}


def oracle(tokenizer, prompt, text, end_of_turn, **kwargs):
    """A sequence's tokens and labels by the template itself: prompt + answer rendered and
    tokenized; labels from the end of the prompt's generation prompt through the last end-of-turn token."""
    ids = template_ids(tokenizer, prompt + answer(text), **kwargs)
    start = len(template_ids(tokenizer, prompt, add_generation_prompt=True, **kwargs))
    end = max(i for i, token in enumerate(ids) if token == tokenizer.convert_tokens_to_ids(end_of_turn)) + 1
    assert start < end
    return ids, [-100] * start + ids[start:end] + [-100] * (len(ids) - end)


def dataset(tmp_path, rows, family="bundled", config=DataConfig(), **kwargs):
    return SampleDataset(write_jsonl(tmp_path / "p.jsonl", rows), family_tokenizer(family), config, pairs=True,
                         **kwargs)


def check_pair(sample, tokenizer, prompt, texts, end_of_turn, **kwargs):
    """The pair sample's format and each of its sequences against the oracle."""
    assert "skip" not in sample, sample.get("detail")
    assert set(sample) == {"uid", "index", "source", "patches", "truncated_tokens", "input_ids", "labels", "pair"}
    assert type(sample["pair"]) is tuple and all(type(n) is int for n in sample["pair"])
    assert sample["input_ids"].dtype == sample["labels"].dtype == torch.int64
    expected = [oracle(tokenizer, prompt, text, end_of_turn, **kwargs) for text in texts]
    assert sample["pair"] == tuple(len(ids) for ids, _ in expected)
    assert sample["input_ids"].tolist() == expected[0][0] + expected[1][0]
    assert sample["labels"].tolist() == expected[0][1] + expected[1][1]
    sequences = pair_sequences(sample)
    assert [set(s) for s in sequences] == [{"input_ids", "labels", "source", "uid", "index"}] * 2
    assert [(s["input_ids"].tolist(), s["labels"].tolist()) for s in sequences] == expected
    labels = sum(1 for _, labels in expected for label in labels if label != -100)
    assert sample_sizes(sample) == (len(expected[0][0]) + len(expected[1][0]), labels, 0, None, len(expected[1][0]))


@pytest.mark.parametrize("family", ["bundled", "qwen2_5"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_gives_the_templates_own_tokens_with_labels_on_each_answer_only(tmp_path, fmt, family):
    record, prompt = FORMATS[fmt]
    tokenizer = family_tokenizer(family)
    sample = dataset(tmp_path, [record], family)[0]
    check_pair(sample, tokenizer, prompt, [CHOSEN, REJECTED], END_OF_TURN[family])
    assert sample["truncated_tokens"] == 0 and sample["patches"] == 0
    chosen, rejected = pair_sequences(sample)
    end = END_OF_TURN[family]
    assert label_runs(tokenizer, chosen["input_ids"], chosen["labels"]) == [CHOSEN + end]
    assert label_runs(tokenizer, rejected["input_ids"], rejected["labels"]) == [REJECTED + end]


def test_a_system_message_folds_into_the_prompt_as_gemma3_folds_it_and_template_kwargs_reach_it(tmp_path):
    record, prompt = FORMATS["e_messages"]
    refused = dataset(tmp_path, [record], "gemma2")[0]
    assert refused["skip"] == "template_mismatch" and "--system_message fold" in refused["detail"]
    folded = dataset(tmp_path, [record], "gemma2", DataConfig(system_message="fold"))[0]
    gemma3 = family_tokenizer("gemma")  # (the same tokens; its template folds the system message itself)
    check_pair(folded, gemma3, prompt, [CHOSEN, REJECTED], "<end_of_turn>")
    no_thinking = {"enable_thinking": False}
    qwen3 = dataset(tmp_path, [FORMATS["b"][0]], "qwen3", DataConfig(chat_template_kwargs=no_thinking))[0]
    check_pair(qwen3, family_tokenizer("qwen3"), FORMATS["b"][1], [CHOSEN, REJECTED], "<|im_end|>", **no_thinking)


# ---- truncation -------------------------------------------------------------------------------------

def words(n):
    return " ".join(["apple"] * n)


def test_the_bundled_tokenizer_spends_one_token_a_word():  # (the hand-computed sizes below rest on it)
    tokenizer = family_tokenizer("bundled")
    for n in (1, 4, 60):
        ids, labels = oracle(tokenizer, [USER], words(n), "<|end|>")
        assert sum(label != -100 for label in labels) == n + 1 == len(ids) - prompt_tokens()


def prompt_tokens():
    return len(template_ids(family_tokenizer("bundled"), [USER], add_generation_prompt=True))


@pytest.mark.parametrize(("chosen", "rejected", "budget", "kept"), [
    (60, 4, 30, (25, 5)),  # the longer cut first: rejected (4 words + <|end|>) whole, chosen 30 - 5
    (4, 60, 30, (5, 25)),
    (40, 50, 31, (15, 16)),  # both over half: the shorter keeps 31 // 2, the longer the rest
    (20, 20, 11, (6, 5)),  # a tie: chosen, the longer on a tie, keeps the odd token
    (20, 30, 2, (1, 1)),  # the least that fits: one answer token each, a label
    (3, 5, 10, (4, 6)),  # fits exactly: nothing cut
])
def test_a_long_pair_is_cut_at_the_ends_of_its_answers_never_in_the_prompt(tmp_path, chosen, rejected, budget, kept):
    tokenizer, prompt = family_tokenizer("bundled"), prompt_tokens()
    record = {"prompt": QUESTION, "chosen": words(chosen), "rejected": words(rejected)}
    sample = dataset(tmp_path, [record], truncate_to=2 * prompt + budget)[0]
    assert "skip" not in sample, sample.get("detail")
    assert sample["pair"] == (prompt + kept[0], prompt + kept[1])
    assert sample["truncated_tokens"] == chosen + 1 + rejected + 1 - sum(kept)
    for sequence, text, keep in zip(pair_sequences(sample), (words(chosen), words(rejected)), kept):
        ids, labels = oracle(tokenizer, [USER], text, "<|end|>")
        assert sequence["input_ids"].tolist() == ids[:prompt + keep]
        assert sequence["labels"].tolist() == labels[:prompt + keep]  # the prompt whole, the answer's first tokens
    assert len(sample["input_ids"]) <= 2 * prompt + budget


def test_a_pair_whose_prompts_do_not_fit_is_over_cap_and_without_a_cap_a_long_pair_stays_whole(tmp_path):
    prompt = prompt_tokens()
    record = {"prompt": QUESTION, "chosen": words(300), "rejected": words(3)}
    skipped = dataset(tmp_path, [record], truncate_to=2 * prompt + 1)[0]
    assert skipped["skip"] == "over_cap" and "max_tokens" in skipped["detail"]
    whole = dataset(tmp_path, [record])[0]
    assert whole["pair"] == (prompt + 301, prompt + 4) and whole["truncated_tokens"] == 0


def test_under_reference_data_a_pair_without_its_log_probs_or_over_the_cap_is_skipped_never_cut(tmp_path):
    """--reference data: the record's log-probs score the whole answers, so a cut pair would train
    against another sequence's reference; a record without them would raise on one rank mid-step."""
    prompt = prompt_tokens()
    refs = {"ref_chosen_logps": -12.5, "ref_rejected_logps": -30.0}
    long = {"prompt": QUESTION, "chosen": words(30), "rejected": words(3), **refs}
    short = {"prompt": QUESTION, "chosen": words(3), "rejected": words(4), **refs}
    bare = {"prompt": QUESTION, "chosen": words(3), "rejected": words(4)}
    cap = 2 * prompt + 20  # the long pair's 30 + 1 + 3 + 1 answer tokens do not fit, the short one's do
    samples = [dataset(tmp_path, [long, short, bare], truncate_to=cap, reference=True)[i] for i in range(3)]
    assert samples[0]["skip"] == "over_cap" and "--reference precompute" in samples[0]["detail"]
    assert "skip" not in samples[1] and samples[1]["ref_logps"] == (-12.5, -30.0)
    assert samples[1]["pair"] == (prompt + 4, prompt + 5)
    assert samples[2]["skip"] == "no_reference" and "ref_rejected_logps" in samples[2]["detail"]
    # the same records without reference 'data': the long pair is cut to fit, the bare one kept
    plain = [dataset(tmp_path, [long, short, bare], truncate_to=cap)[i] for i in range(3)]
    assert [("skip" in sample) for sample in plain] == [False, False, False]
    assert len(plain[0]["input_ids"]) == cap and plain[0]["truncated_tokens"] == 15
    whole = dataset(tmp_path, [long], reference=True)[0]  # no cap: whole (an evaluation's samples)
    assert whole["pair"] == (prompt + 31, prompt + 4) and whole["ref_logps"] == (-12.5, -30.0)


def test_the_answer_budget_of_the_brief():
    # chosen 6000 answer tokens, rejected 40, prompts of 100, budget 4096: the rejected stays whole
    assert pair_answer_tokens((100, 100), (6100, 140), 4096) == (3856, 40)
    assert pair_answer_tokens((100, 100), (6100, 140), 6340) == (6000, 40)


# ---- skips ----------------------------------------------------------------------------------------

HIDES = ("{% for message in messages %}{% if message['role'] == 'assistant' and 'hidden' in message['content'] %}"
         "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
         "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The bundled template, but an assistant turn that says 'hidden' renders as nothing."""

SKIPS = {
    "not_a_pair": [{"messages": HISTORY}, {"prompt": QUESTION, "chosen": CHOSEN},
                   {"chosen": answer(CHOSEN), "rejected": answer(REJECTED)},
                   {"prompt": QUESTION, "chosen": answer(CHOSEN) + [USER], "rejected": answer(REJECTED)},
                   {"prompt": [], "chosen": CHOSEN, "rejected": REJECTED}],
    "no_assistant_turn": [{"prompt": QUESTION, "chosen": [USER], "rejected": [USER]}],
    "pair_prompt_mismatch": [
        {"chosen": [USER] + answer(CHOSEN), "rejected": [{"role": "user", "content": "Other?"}] + answer(REJECTED)},
        {"chosen": HISTORY + [USER] + answer(CHOSEN), "rejected": [USER] + answer(REJECTED)},
        {"prompt": "Other?", "chosen": [USER] + answer(CHOSEN), "rejected": [USER] + answer(REJECTED)},
        {"prompt": [USER], "chosen": HISTORY + [USER] + answer(CHOSEN),
         "rejected": HISTORY + [USER] + answer(REJECTED)},
        {"prompt": QUESTION, "chosen": [USER] + answer(CHOSEN), "rejected": answer(REJECTED)}],
    "bad_content": [{"messages": [SYSTEM, USER], "system": "Twice.", "chosen": CHOSEN, "rejected": REJECTED},
                    {"system": "Twice.", "chosen": [SYSTEM, USER] + answer(CHOSEN),
                     "rejected": [SYSTEM, USER] + answer(REJECTED)}],
}


@pytest.mark.parametrize("reason", sorted(SKIPS))
def test_records_that_are_no_pair_are_skipped_with_their_reason(tmp_path, reason):
    assert reason in SKIP_REASONS
    data = dataset(tmp_path, SKIPS[reason])
    for i, record in enumerate(SKIPS[reason]):
        assert data[i].get("skip") == reason, (record, data[i].get("detail"))
    if reason == "not_a_pair":
        assert "'chosen' and 'rejected'" in data[0]["detail"] and "['messages']" in data[0]["detail"]


def test_an_answer_the_template_renders_as_nothing_has_no_labels(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizer"))
    tokenizer.chat_template = HIDES
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": QUESTION, "chosen": CHOSEN, "rejected": "hidden"}])
    sample = SampleDataset(path, tokenizer, pairs=True)[0]
    assert sample["skip"] == "no_labels" and "rejected" in sample["detail"]


def test_a_preference_record_read_as_sft_is_skipped_naming_the_objective(tmp_path):
    rows = [record for record, _ in FORMATS.values()]
    sft = SampleDataset(write_jsonl(tmp_path / "p.jsonl", rows), family_tokenizer("bundled"))
    for i, name in enumerate(FORMATS):
        skip = sft[i]
        reason = "preference_record" if name.startswith("e") else "no_messages"  # (a-d: no messages, as before)
        assert skip.get("skip") == reason and "--objective" in skip["detail"], (name, skip)
    # the silent case it replaces: prompt turns with an assistant turn trained as SFT, neither answer
    assert SampleDataset(write_jsonl(tmp_path / "s.jsonl", [{"messages": HISTORY}]), family_tokenizer("bundled"))[0][
        "input_ids"].numel()


@pytest.mark.parametrize("option", [{"turn_sampling": True}, {"system_prompts": ("Hi.",), "system_prompt_prob": 0.5}])
def test_augmentation_is_refused_for_pairs_naming_the_option(tmp_path, option):
    (name,) = [key for key in option if key != "system_prompts"]
    with pytest.raises(ValueError, match=f"{name} .*reference log-probs"):
        dataset(tmp_path, [FORMATS["a"][0]], config=DataConfig(**option))


# ---- images ---------------------------------------------------------------------------------------

def image_record(tmp_path, **extra):
    Image.new("RGB", (56, 84), (200, 10, 10)).save(tmp_path / "red.png")
    return {"images": ["red.png"], "prompt": [{"role": "user", "content": [{"type": "image"},
                                                                           {"type": "text", "text": "\nWhat color?"}]}],
            "chosen": "Red.", "rejected": "Blue, or maybe green, it is hard to say.", **extra}


def test_both_sequences_carry_the_prompts_images(tmp_path):
    tokenizer = family_tokenizer("qwen2_vl")
    record = image_record(tmp_path)
    sample = dataset(tmp_path, [record], "qwen2_vl", vision=VisionSpec())[0]
    assert "skip" not in sample, sample.get("detail")
    assert sample["image_grid_thw"].tolist() == [[1, 6, 4], [1, 6, 4]] and sample["patches"] == 48
    half = len(sample["pixel_values"]) // 2
    assert torch.equal(sample["pixel_values"][:half], sample["pixel_values"][half:])
    pads = "<|image_pad|>" * 6  # 56 x 84: 6 x 4 patches, merged 2 x 2
    for sequence, text in zip(pair_sequences(sample), (record["chosen"], record["rejected"])):
        stock = tokenizer.apply_chat_template(record["prompt"] + answer(text), tokenize=False)
        assert tokenizer.decode(sequence["input_ids"]) == stock.replace("<|image_pad|>", pads)
        assert label_runs(tokenizer, sequence["input_ids"], sequence["labels"]) == [text + "<|im_end|>"]
        assert sequence["image_grid_thw"].tolist() == [[1, 6, 4]] and sequence["patches"] == 24
    single = SampleDataset(write_jsonl(tmp_path / "s.jsonl", [{"images": ["red.png"], "messages": record["prompt"]
                                                               + answer("Red.")}]), tokenizer, vision=VisionSpec())[0]
    assert torch.equal(sample["pixel_values"][:half], single["pixel_values"])
    text_model = dataset(tmp_path, [record], "qwen2_vl")[0]
    assert text_model["skip"] == "image_for_text_model"


def test_an_image_in_an_answer_is_not_supported(tmp_path):
    shows = [{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "This one."}]}]
    record = image_record(tmp_path, prompt="What color?", chosen=shows)
    sample = dataset(tmp_path, [record], "qwen2_vl", vision=VisionSpec())[0]
    assert sample["skip"] == "pair_media_not_supported" and "prompt" in sample["detail"]


# ---- the bundled demo data ------------------------------------------------------------------------

def test_the_bundled_preference_data_is_the_tools_and_every_record_is_a_pair_of_uneven_answers():
    path = ROOT / "data" / "preference.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == tool_module("make_preference_data").rows()
    kinds = {("prompt" in r and isinstance(r["prompt"], str), "prompt" in r, isinstance(r["chosen"], list),
              "messages" in r or "conversations" in r) for r in rows}
    assert {(True, True, False, False), (False, True, True, False), (True, True, True, False),
            (False, False, True, False), (False, False, False, True)} <= kinds  # a, b, c, d, e
    data = SampleDataset(path, family_tokenizer("bundled"), pairs=True)
    samples = [data[i] for i in range(len(data))]
    assert not [s["detail"] for s in samples if "skip" in s]
    assert max(max(s["pair"]) / min(s["pair"]) for s in samples) > 10
    assert all(split_pair(r) for r in rows)


def test_both_sequences_carry_the_prompts_videos_and_each_is_what_the_model_takes(tmp_path):
    media(tmp_path)  # (an image and two videos in one prompt: RECORDS[2])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config_dict("qwen2_5_vl")),
                                                    attn_implementation="eager").eval()
    vision = vision_spec(model, SMALL, source=None)
    prompt, answers = RECORDS[2]["messages"][:1], ("No.", "Yes, they are the same clip, only longer.")
    record = {"messages": prompt, "videos": RECORDS[2]["videos"], "chosen": answers[0], "rejected": answers[1]}
    sample = SampleDataset(write_jsonl(tmp_path / "p.jsonl", [record]), VIDEO_TOKENIZER, SMALL, vision=vision,
                           pairs=True)[0]
    assert "skip" not in sample, sample.get("detail")
    singles = [SampleDataset(write_jsonl(tmp_path / f"s{i}.jsonl", [{"messages": prompt + answer(text), "videos":
                                                                       RECORDS[2]["videos"]}]),
                             VIDEO_TOKENIZER, dataclasses.replace(SMALL, train_on="last"), vision=vision)[0]
               for i, text in enumerate(answers)]  # each side alone, as an SFT sample of its final turn
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        assert torch.equal(sample[key], torch.cat([singles[0][key], singles[0][key]])), key
    assert sample["patches"] == 2 * singles[0]["patches"] and len(sample["video_grid_thw"]) == 4
    for sequence, single in zip(pair_sequences(sample), singles):
        assert torch.equal(sequence["input_ids"], single["input_ids"]) and torch.equal(sequence["labels"],
                                                                                      single["labels"])
        assert sequence["patches"] == single["patches"]
        with torch.no_grad():
            out = model(labels=sequence["labels"][None], **model_inputs(sequence))
        assert torch.isfinite(out.loss)


def test_a_run_whose_first_pairs_mostly_have_no_reference_stops_naming_the_fix(tmp_path):
    """--reference data over records without ref log-probs: each is skipped (no_reference); the
    first round's figures stop the run instead of training nothing and ending as if it had."""
    from odb.training.run.first_round import check_first_round

    records = [{"prompt": QUESTION, "chosen": words(3), "rejected": words(4)}] * 3
    samples = [dataset(tmp_path, records, reference=True)[i] for i in range(3)]
    skipped = dict(Counter(s["skip"] for s in samples))
    assert skipped == {"no_reference": 3}
    with pytest.raises(ValueError, match="3 of the first 3 pairs have no ref_chosen_logps.*--reference precompute"):
        check_first_round(skipped, 3)
    check_first_round({"no_reference": 1}, 3)  # a few: skipped and counted, the run goes on
