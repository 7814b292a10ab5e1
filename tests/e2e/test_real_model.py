"""A user's first real run: a Hugging Face model folder with its family's stock chat template (no
``{% generation %}`` blocks), on 2 DeepSpeed ranks at ZeRO-3, with validation and a
Hugging Face model at the end; and the cuts a real corpus needs, counted exactly."""

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import bundled_tokenizer
from launch import ROOT, deepspeed, deepspeed_watched, ds_config, odb_config, write_json
from odb.training.model.build import load_tokenizer

TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
FAMILIES = {
    # family: (template fixture, special tokens it needs, tokenizer attributes)
    "qwen2": ("qwen2_5.jinja", ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"}),
    "llama": ("llama3.jinja", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}


def model_folder(tmp_path, family: str):
    """A tiny model of ``family`` saved with save_pretrained, beside a tokenizer that carries the
    family's stock template and special tokens, as a downloaded model folder would."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    template, specials, attributes = FAMILIES[family]
    tokenizer = copy.deepcopy(bundled_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    for name, value in attributes.items():
        setattr(tokenizer, name, value)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    folder = tmp_path / family
    (folder / "config.json").parent.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": family}))  # as a model folder has it
    tokenizer.save_pretrained(folder)
    tokenizer = load_tokenizer(folder)  # what the run will load (the family's class may add tokens)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM(Qwen2Config(**sizes)) if family == "qwen2" else LlamaForCausalLM(LlamaConfig(**sizes)))
    model.save_pretrained(folder)
    return folder, tokenizer


def chatml_labels(tokenizer, messages) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle for ChatML: input ids, and labels on each assistant answer and its <|im_end|>,
    found by a regular expression over the rendered text (not odb's code)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(1) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, flags=re.S)]
    ids = torch.tensor(encoded["input_ids"])
    keep = torch.tensor([any(a <= s and e <= b for a, b in spans) for s, e in encoded["offset_mapping"]])
    return ids, torch.where(keep, ids, -100)


def test_a_qwen2_folder_with_its_stock_template_learns_evaluates_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, tokenizer = model_folder(tmp_path, "qwen2")
    records = [json.loads(line) for line in (ROOT / "data" / "chat.jsonl").read_text().splitlines()]
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in records[200:216]))
    out = tmp_path / "run"
    deepspeed(["--model", str(folder), "--deepspeed_config", str(ds_config(tmp_path, 3)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=1024, window=32)), "--max_samples", "96",
               "--eval_data", str(eval_path), "--eval_steps", "4", "--lr", "3e-3", "--save_hf",
               "--no_final_checkpoint", "--output_dir", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [r for r in rows if "eval_loss" not in r], [r for r in rows if "eval_loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    assert steps and all(r["label_tokens"] > 0 for r in steps), "a step trained on no label token"
    assert summary["label_tokens"] == sum(r["label_tokens"] for r in steps) > 0
    assert summary["loss_last"] < summary["loss_first"]
    n = len(steps)
    assert [r["step"] for r in evals] == list(range(3, n, 4)) + ([n - 1] if n % 4 else []) and len(evals) >= 2
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] and summary["eval_loss"] == evals[-1]["eval_loss"]
    assert rows.index(evals[0]) == 4, "the eval row comes right after the step it follows"

    # the exported model loads without odb and its validation loss is the run's last eval_loss
    exported = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert exported.config.use_cache and "odb" not in str(exported.config._attn_implementation)
    assert AutoTokenizer.from_pretrained(out / "hf").chat_template == tokenizer.chat_template
    total, count = 0.0, 0
    with torch.no_grad():
        for record in records[200:216]:
            ids, labels = chatml_labels(tokenizer, record["messages"])
            logits = exported(input_ids=ids[None]).logits[0].double()
            total += float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"))
            count += int((labels[1:] != -100).sum())
    assert evals[-1]["eval_label_tokens"] == count
    assert abs(total / count - summary["eval_loss"]) < 2e-5, (total / count, summary["eval_loss"])


def test_a_llama_folder_with_its_stock_template_and_a_validation_split(tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _ = model_folder(tmp_path, "llama")
    out = tmp_path / "run"
    deepspeed(["--model", str(folder), "--deepspeed_config", str(ds_config(tmp_path, 3)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=1024, window=32)), "--max_samples", "80",
               "--val_ratio", "0.2", "--lr", "3e-3", "--lora", "--save_hf", "--save_total_limit", "1",
               "--save_steps", "2", "--output_dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["samples_emitted"] == 64 and summary["config"]["data"]["val_ratio"] == 0.2
    assert all(r["label_tokens"] > 0 for r in steps if "eval_loss" not in r)
    assert summary["eval_loss"] is not None and summary["eval_loss"] > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [f"step{summary['steps']}"]
    merged = AutoModelForCausalLM.from_pretrained(out / "hf")  # LoRA merged: no peft needed
    assert merged.config.model_type == "llama" and not hasattr(merged, "peft_config")


def long_chats(tmp_path, count: int, turns: int):
    rows = [{"messages": [m for t in range(turns) for m in (
        {"role": "user", "content": f"Question {t} of chat {i}: " + "tell me more " * (3 + (i + t) % 5)},
        {"role": "assistant", "content": f"Answer {t}: " + "here is more " * (4 + (i * t) % 7)})]}
        for i in range(count)]
    return write_json(tmp_path / "long.json", rows)


@pytest.mark.parametrize("truncation", ["turns", "tokens"])
def test_every_cut_is_counted_exactly(tmp_path, truncation):
    tokenizer = bundled_tokenizer()
    data = long_chats(tmp_path, 24, turns=8)
    records = json.loads(data.read_text())
    full = [len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
            for r in records]
    cap = 256
    out = tmp_path / "run"
    proc = deepspeed(["--data", str(data), "--deepspeed_config", str(ds_config(tmp_path, 2)),
                      "--odb_config", str(odb_config(tmp_path, max_tokens=cap, window=8)),
                      "--data_config", str(write_json(tmp_path / "data.json", {"truncation": truncation})),
                      "--no_final_checkpoint", "--output_dir", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["truncated_samples"] == sum(n > cap for n in full) > 12
    assert summary["real_tokens"] + summary["truncated_tokens"] == sum(full)
    if truncation == "tokens":
        assert summary["real_tokens"] == sum(min(n, cap) for n in full)
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert (last["truncated_samples"], last["truncated_tokens"]) == (summary["truncated_samples"],
                                                                     summary["truncated_tokens"])
    assert "cut to max_tokens=256" in proc.stdout + proc.stderr


def test_a_template_that_leaves_nothing_to_learn_stops_every_rank_at_start(tmp_path):
    # every record's system prompt alone is over the cap: the token cut leaves no assistant token
    rows = [{"messages": [{"role": "system", "content": "be brief " * 80}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": f"hello {i}"}]} for i in range(40)]
    code, output, _ = deepspeed_watched([
        "--data", str(write_json(tmp_path / "d.json", rows)), "--deepspeed_config", str(ds_config(tmp_path, 2)),
        "--odb_config", str(odb_config(tmp_path, max_tokens=64, window=8)), "--output_dir", str(tmp_path / "o")])
    assert code != 0
    assert output.count("have no label tokens") >= 2, output[-3000:]  # both ranks say why
    assert "train_on" in output and "max_tokens" in output
