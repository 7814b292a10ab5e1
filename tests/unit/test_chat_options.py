"""The data config's chat options: ``system_message`` 'fold' (for templates that refuse or drop a
system message) and ``chat_template_kwargs`` (the template's variables), from the records to the
run's settings.

Fixtures: the stock templates of Mistral-7B-Instruct-v0.3 (drops the system message from a finished
conversation), Gemma 2 (raises on one), Gemma 3 (folds it itself), Qwen3 (``enable_thinking``) and
Llama 3.1 (``date_string``), tests/fixtures/templates. The oracles: each template's own
``apply_chat_template`` (the conversation folded by hand; Gemma 3's own fold; the generation prompt
with the same variables), and the label runs spelled out by hand.
"""

import dataclasses
import json

import pytest
from test_labels import FIRST, SECOND, SYSTEM, family_tokenizer, label_runs, template_ids, write_jsonl
from transformers import AutoConfig

from conftest import ROOT, bundled_tokenizer, train_defaults
from odb.batching.align import Aligner, SettingsMismatch
from odb.batching.simulate import run_ranks
from odb.data.config import DataConfig, load_data_config
from odb.data.processing import SampleDataset
from odb.integrations.core import OdbSettings, host_config
from odb.recipe import load_recipe
from odb.training.config.settings import DataSettings
from odb.training.launch.flags import parse_config

FOLDED = [{"role": "user", "content": "You are terse.\n\nHello?"}, FIRST[1]]
"""[SYSTEM] + FIRST with the system text folded into the user turn, by hand."""
NO_THINKING = {"enable_thinking": False}


def sample_of(tmp_path, family, messages, config=DataConfig()):
    return SampleDataset(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}]), family_tokenizer(family),
                         config)[0]


def first_label(sample) -> int:
    return int((sample["labels"] != -100).nonzero()[0])


# ---- system_message -------------------------------------------------------------------------------

def test_mistral_v0_3_trains_a_system_message_folded_into_the_first_user_turn(tmp_path):
    tokenizer = family_tokenizer("mistral_v0_3")
    kept = sample_of(tmp_path, "mistral_v0_3", [SYSTEM] + FIRST)  # the default: skipped, naming the option
    assert kept["skip"] == "template_mismatch" and "drops the system message ('You are terse.')" in kept["detail"]
    assert "set system_message to 'fold' in the data config (--system_message fold)" in kept["detail"]
    fold = DataConfig(system_message="fold")
    single = sample_of(tmp_path, "mistral_v0_3", [SYSTEM] + FIRST, fold)
    assert single["input_ids"].tolist() == template_ids(tokenizer, FOLDED)
    # the prompt trained on is the template's own inference prompt for that system message and user turn
    inference = tokenizer.apply_chat_template([SYSTEM, FIRST[0]], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(single["input_ids"][:first_label(single)]) == inference == "<s>[INST] You are terse.\n\n" \
                                                                                        "Hello?[/INST]"
    assert label_runs(tokenizer, single["input_ids"], single["labels"]) == [" Hi there!</s>"]
    multi = sample_of(tmp_path, "mistral_v0_3", [SYSTEM] + FIRST + SECOND, fold)
    assert multi["input_ids"].tolist() == template_ids(tokenizer, FOLDED + SECOND)
    assert label_runs(tokenizer, multi["input_ids"], multi["labels"]) == [" Hi there!</s>", " Second answer.</s>"]
    moved = sample_of(tmp_path, "mistral_v0_3", [SYSTEM] + FIRST + SECOND[:1])
    assert moved["skip"] == "template_mismatch" and "--system_message fold" in moved["detail"]


def test_gemma2_refuses_a_system_message_naming_fold_which_trains_it_as_gemma3_folds_it(tmp_path):
    refused = sample_of(tmp_path, "gemma2", [SYSTEM] + FIRST)
    assert refused["skip"] == "template_mismatch"  # (was 'error', the template's exception alone)
    assert "System role not supported" in refused["detail"] and "--system_message fold" in refused["detail"]
    gemma2, gemma3 = family_tokenizer("gemma2"), family_tokenizer("gemma")
    for messages in ([SYSTEM] + FIRST, [SYSTEM] + FIRST + SECOND):
        folded = sample_of(tmp_path, "gemma2", messages, DataConfig(system_message="fold"))
        assert folded["input_ids"].tolist() == template_ids(gemma3, messages)  # Gemma 3's template folds it so
        runs = label_runs(gemma2, folded["input_ids"], folded["labels"])
        assert runs == ["Hi there!<end_of_turn>", "Second answer.<end_of_turn>"][:len(messages) // 2]
    other = sample_of(tmp_path, "gemma2", [FIRST[1], FIRST[0], FIRST[1]])  # refused for another reason: as before
    assert other["skip"] == "error" and "roles must alternate" in other["detail"]


def test_an_augmented_system_prompt_is_folded_too(tmp_path):
    tokenizer = family_tokenizer("mistral_v0_3")
    config = DataConfig(system_message="fold", system_prompts=("You are terse.",), system_prompt_prob=1.0)
    sample = sample_of(tmp_path, "mistral_v0_3", FIRST, config)
    assert sample["input_ids"].tolist() == template_ids(tokenizer, FOLDED)
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == [" Hi there!</s>"]


def test_fold_system_messages():
    from odb.data.formats import fold_system_messages

    empty, later = {"role": "system", "content": "  "}, {"role": "system", "content": "Now in French."}
    messages = [SYSTEM, {"role": "system", "content": "Be kind."}, *FIRST, later, *SECOND]
    assert fold_system_messages(messages) == [
        {"role": "user", "content": "You are terse.\n\nBe kind.\n\nHello?"}, FIRST[1],
        {"role": "user", "content": "Now in French.\n\nAnd again?"}, SECOND[1]]
    assert messages[2] == FIRST[0] and len(messages) == 7  # (the input is left as it was)
    assert fold_system_messages([empty, *FIRST]) == FIRST  # nothing to fold
    assert fold_system_messages([*FIRST, later]) == [*FIRST, later]  # no user turn after it: left in place
    assert fold_system_messages([SYSTEM, FIRST[1]]) == [SYSTEM, FIRST[1]]


# ---- chat_template_kwargs -------------------------------------------------------------------------

def test_qwen3_enable_thinking_reaches_the_text_and_the_labels(tmp_path):
    tokenizer = family_tokenizer("qwen3")
    default = sample_of(tmp_path, "qwen3", FIRST)  # the empty think block is the answer's
    assert label_runs(tokenizer, default["input_ids"], default["labels"]) == [
        "<think>\n\n</think>\n\nHi there!<|im_end|>"]
    sample = sample_of(tmp_path, "qwen3", FIRST, DataConfig(chat_template_kwargs=NO_THINKING))
    assert sample["input_ids"].tolist() == template_ids(tokenizer, FIRST, **NO_THINKING)
    # enable_thinking=false puts the empty think block into the generation prompt: the model is given it
    prompt = tokenizer.apply_chat_template(FIRST[:1], tokenize=False, add_generation_prompt=True, **NO_THINKING)
    assert tokenizer.decode(sample["input_ids"][:first_label(sample)]) == prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == ["Hi there!<|im_end|>"]
    last = sample_of(tmp_path, "qwen3", FIRST + SECOND, DataConfig(train_on="last", chat_template_kwargs=NO_THINKING))
    assert last["input_ids"].tolist() == template_ids(tokenizer, FIRST + SECOND, **NO_THINKING)
    assert label_runs(tokenizer, last["input_ids"], last["labels"]) == ["Second answer.<|im_end|>"]


def test_llama3_1_date_string_reaches_the_text_and_the_labels_stay_on_the_answers(tmp_path):
    tokenizer, kwargs = family_tokenizer("llama3_1"), {"date_string": "01 Jan 2025"}
    messages = [SYSTEM] + FIRST + SECOND
    sample = sample_of(tmp_path, "llama3_1", messages, DataConfig(chat_template_kwargs=kwargs))
    assert sample["input_ids"].tolist() == template_ids(tokenizer, messages, **kwargs)
    assert "Today Date: 01 Jan 2025\n\nYou are terse." in tokenizer.decode(sample["input_ids"])
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == ["Hi there!<|eot_id|>",
                                                                            "Second answer.<|eot_id|>"]


@pytest.mark.parametrize(("values", "named"), [
    ({"chat_template_kwargs": {"add_generation_prompt": True}}, "may not set ['add_generation_prompt']"),
    ({"chat_template_kwargs": {"tools": []}}, "may not set ['tools']"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs must map template variable names"),
    ({"chat_template_kwargs": {"enable thinking": False}}, "chat_template_kwargs must map template variable names"),
    ({"chat_template_kwargs": {"x": float("nan")}}, "chat_template_kwargs must hold JSON values"),
    ({"system_message": "drop"}, "system_message must be one of ('keep', 'fold')"),
])
def test_bad_chat_options_name_the_key(tmp_path, values, named):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError) as err:
        load_data_config(path)
    assert named in str(err.value)


# ---- the run's settings: flags, recipes, adapters, run_config.json, the ranks' check ---------------

def test_the_flags_a_recipe_and_the_data_config_set_both_options(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = ["--output_dir", str(tmp_path / "o")]
    flagged = parse_config([*out, "--chat_template_kwargs", '{"enable_thinking": false}', "--system_message", "fold"],
                           defaults=train_defaults())
    assert flagged.data.processing == DataConfig(chat_template_kwargs=NO_THINKING, system_message="fold")
    saved = json.loads(json.dumps(flagged.to_dict()))  # (what run_config.json and summary.json hold)
    assert saved["data"]["processing"]["chat_template_kwargs"] == NO_THINKING
    assert saved["data"]["processing"]["system_message"] == "fold"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("chat_template_kwargs: {enable_thinking: false}\nsystem_message: fold\n")
    assert parse_config(out, defaults=train_defaults(), recipe=load_recipe(recipe)) == flagged
    recipe.write_text("data_config: {chat_template_kwargs: {enable_thinking: false}, system_message: fold}\n")
    assert parse_config(out, defaults=train_defaults(), recipe=load_recipe(recipe)) == flagged
    overridden = parse_config(out, defaults=train_defaults(),  # odb train's key=value over the recipe's
                              recipe=load_recipe(recipe, overrides=["chat_template_kwargs={date_string: today}"]))
    assert overridden.data.processing.chat_template_kwargs == {"date_string": "today"}  # (the flag's mapping wins)
    with pytest.raises(ValueError, match="--chat_template_kwargs must be a JSON object such as"):
        parse_config([*out, "--chat_template_kwargs", "enable_thinking=false"], defaults=train_defaults())
    word = json.dumps({"name": "think", "path": str(ROOT / "data" / "chat.jsonl"), "chat_template_kwargs": NO_THINKING})
    source = parse_config([*out, "--data", word], defaults=train_defaults())
    assert source.data.sources[0].processing == {"chat_template_kwargs": NO_THINKING}  # a source's own
    host = host_config(OdbSettings(data=DataSettings(path="d.jsonl", processing=flagged.data.processing),
                                   batching=flagged.batching), model_path="m", output_dir=tmp_path / "h", lr=1e-5,
                       warmup_ratio=0.0, weight_decay=0.0, epochs=1, gas=1)
    assert host.data.processing.chat_template_kwargs == NO_THINKING  # the HF / TRL / Accelerate adapters' data


def test_ranks_with_other_chat_template_kwargs_stop_at_start_naming_the_data_settings(tmp_path, monkeypatch):
    from odb.training.run.assemble import shared_settings

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model_config = AutoConfig.for_model(**json.loads((ROOT / "configs" / "tiny_model.json").read_text()))
    config = parse_config(["--output_dir", str(tmp_path / "o")], defaults=train_defaults())
    errors = []

    def check(comm):
        processing = DataConfig(chat_template_kwargs={"enable_thinking": comm.rank == 0})
        dataset = SampleDataset(config.data.path, bundled_tokenizer(), processing, max_samples=2)
        run = dataclasses.replace(config, data=dataclasses.replace(config.data, processing=processing))
        try:
            Aligner(comm).check_settings(shared_settings(run, model_config, dataset, None))
        except SettingsMismatch as err:
            errors.append(str(err))

    run_ranks(2, check)
    assert len(errors) == 2 and all("'data.processing': rank(s) [1] differ from rank 0" in e for e in errors)
