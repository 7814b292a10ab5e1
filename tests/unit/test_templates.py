"""Tool calls, reasoning, and templates that part from the plain prefix picture (odb.data.formats,
odb.data.labels), through SampleDataset as a run processes records.

Fixtures: the public chat templates of Qwen2.5-Instruct (tool calling), Qwen3, Llama 3.1,
Mistral-7B-Instruct-v0.3, Phi-3(.5)-mini and DeepSeek-R1-Distill-Qwen (tests/fixtures/templates).
The oracle for the tokens is each template's own ``apply_chat_template(messages, tools=...,
tokenize=True)``; the label runs (the assistant's content, tool calls and end token) are spelled
out by hand.
"""

import json

import pytest
from test_labels import FIRST, SECOND, SYSTEM, family_tokenizer, label_runs, template_ids, write_jsonl

from odb.data.labels import encode_chat
from odb.data.processing import DataConfig, SampleDataset

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [  # the OpenAI / transformers message format
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."}]
QWEN3_TOOL_CHAT = [  # (Qwen3's template reads content as a string: "" where the turn only calls tools)
    TOOL_CHAT[0],
    {"role": "assistant", "content": "", "reasoning_content": "Need the weather tool.", "tool_calls": [CALL]},
    TOOL_CHAT[2], {"role": "assistant", "content": "It is 21 degrees in Paris.", "reasoning_content": "21 degrees."}]

TOOL_RUNS = {  # per family: the messages, then what it trains on: the call, the answer, each with its end token
    "qwen2_5_tools": (TOOL_CHAT, ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                                  '<|im_end|>', "It is 21 degrees in Paris.<|im_end|>"]),
    "qwen3": (QWEN3_TOOL_CHAT, ['<think>\nNeed the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                                '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                                "<think>\n21 degrees.\n</think>\n\nIt is 21 degrees in Paris.<|im_end|>"]),
    "llama3_1": (TOOL_CHAT, ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                             "It is 21 degrees in Paris.<|eot_id|>"]),
    "mistral_v0_3": (TOOL_CHAT, ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
                                 '"id": "call00001"}]</s>', " It is 21 degrees in Paris.</s>"]),
}
TOOL_RESULTS = {  # how each template shows the tool's result (never labelled)
    "qwen2_5_tools": '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n',
    "qwen3": '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n',
    "llama3_1": '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 21}"<|eot_id|>',
    "mistral_v0_3": '[TOOL_RESULTS] {"content": {"temp": 21}, "call_id": "call00001"}[/TOOL_RESULTS]',
}


def sample_of(tmp_path, family, record, config=DataConfig()):
    return SampleDataset(write_jsonl(tmp_path / "d.jsonl", [record]), family_tokenizer(family), config)[0]


@pytest.mark.parametrize("family", list(TOOL_RUNS))
def test_tool_calls_tool_turns_and_reasoning_are_trained_as_each_template_renders_them(tmp_path, family):
    messages, runs = TOOL_RUNS[family]
    tokenizer = family_tokenizer(family)
    sample = sample_of(tmp_path, family, {"messages": messages, "tools": TOOLS})
    assert "skip" not in sample, sample.get("detail")
    assert sample["input_ids"].tolist() == template_ids(tokenizer, messages, tools=TOOLS)
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == runs
    text = tokenizer.decode(sample["input_ids"])
    assert TOOL_RESULTS[family] in text and '"description": "The weather in a city."' in text  # the tools offered


SHAREGPT_TOOLS = [{"name": "get_weather", "description": "The weather in a city.",  # LLaMA-Factory: bare schemas
                   "parameters": TOOLS[0]["function"]["parameters"]}]
RECORD_STYLES = {  # the same conversation for Qwen2.5's template, as datasets write it
    "openai": {"messages": TOOL_CHAT, "tools": TOOLS},
    "content-absent": {"messages": [TOOL_CHAT[0], {"role": "assistant", "tool_calls": [CALL]}, *TOOL_CHAT[2:]],
                       "tools": TOOLS},
    "flat-call-function-role": {"messages": [
        TOOL_CHAT[0], {"role": "assistant", "content": None, "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]},
        {"role": "function", "name": "get_weather", "content": '{"temp": 21}'}, TOOL_CHAT[3]], "tools": TOOLS},
    "parquet-nulls": {"messages": [{**m, **{k: m.get(k) for k in ("tool_calls", "reasoning_content", "name",
                                                                    "tool_call_id")}} for m in TOOL_CHAT],
                      "tools": TOOLS},
    "sharegpt": {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "It is 21 degrees in Paris."}], "tools": json.dumps(SHAREGPT_TOOLS)},
}


@pytest.mark.parametrize("style", list(RECORD_STYLES))
def test_every_record_style_of_a_tool_call_gives_the_template_s_own_tokens(tmp_path, style):
    tokenizer = family_tokenizer("qwen2_5_tools")
    sample = sample_of(tmp_path, "qwen2_5_tools", RECORD_STYLES[style])
    assert "skip" not in sample, sample.get("detail")
    assert sample["input_ids"].tolist() == template_ids(tokenizer, TOOL_CHAT, tools=TOOLS)
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == TOOL_RUNS["qwen2_5_tools"][1]


def test_qwen3_renders_the_reasoning_of_the_last_turn_not_an_empty_think_block(tmp_path):
    tokenizer = family_tokenizer("qwen3")
    messages = [FIRST[0], {**FIRST[1], "reasoning_content": "I should greet."}]
    sample = sample_of(tmp_path, "qwen3", {"messages": messages})
    assert sample["input_ids"].tolist() == template_ids(tokenizer, messages)
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == [
        "<think>\nI should greet.\n</think>\n\nHi there!<|im_end|>"]
    # its template drops the reasoning of turns before the last user query: 'last' trains the final one
    turns = messages + [SECOND[0], {**SECOND[1], "reasoning_content": "Again."}]
    skipped = sample_of(tmp_path, "qwen3", {"messages": turns})
    assert skipped["skip"] == "template_mismatch" and "rewrites past turns" in skipped["detail"]
    last = sample_of(tmp_path, "qwen3", {"messages": turns}, DataConfig(train_on="last"))
    assert last["input_ids"].tolist() == template_ids(tokenizer, turns)
    assert label_runs(tokenizer, last["input_ids"], last["labels"]) == [
        "<think>\nAgain.\n</think>\n\nSecond answer.<|im_end|>"]


def chat(*turns, **extra):
    return {"messages": list(turns), **extra}


USER = {"role": "user", "content": "Weather in Paris?"}


@pytest.mark.parametrize("record, reason", [
    (chat(USER, {"role": "assistant", "content": None, "tool_calls": {"name": 5}}), "bad_content"),
    (chat(USER, {"role": "assistant", "content": None, "tool_calls": [{"arguments": {}}]}), "bad_content"),
    (chat(USER, {"role": "assistant", "content": None, "tool_calls": ["get_weather"]}), "bad_content"),
    (chat({**USER, "tool_calls": [CALL]}, {"role": "assistant", "content": "Sunny."}), "bad_content"),
    (chat(USER, {"role": "assistant", "content": None}), "bad_content"),
    (chat(USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": 3}), "bad_content"),
    (chat(USER, {"role": "assistant", "content": "Sunny."}, tools={"name": "get_weather"}), "bad_content"),
    (chat(USER, {"role": "assistant", "content": "Sunny."}, tools="[{not json"), "bad_content"),
    (chat({"role": "developer", "content": "Be brief."}, USER, {"role": "assistant", "content": "Sunny."}),
     "bad_role"),
    (chat(USER, {"role": "assistant", "content": " "}), "empty_content"),
], ids=["calls-not-a-list", "call-without-name", "call-not-an-object", "calls-on-a-user-turn", "no-content-no-call",
        "reasoning-not-a-string", "tools-not-a-list", "tools-bad-json", "unknown-role", "empty-answer"])
def test_malformed_tool_records_are_skipped_with_a_reason(tmp_path, record, reason):
    sample = sample_of(tmp_path, "qwen2_5_tools", record)
    assert sample.get("skip") == reason, sample.get("detail", sample.keys())


# ---- templates that part from the prefix picture ----------------------------------------------------


@pytest.mark.parametrize("family", ["phi3_mini", "phi3_5_mini"])
def test_phi3_s_eos_trailer_is_neither_a_mismatch_nor_a_label(tmp_path, family):
    tokenizer = family_tokenizer(family)
    messages = [SYSTEM] + FIRST + SECOND
    for train_on, runs in (("assistant", ["Hi there!<|end|>", "Second answer.<|end|>"]),
                           ("last", ["Second answer.<|end|>"])):
        sample = sample_of(tmp_path, family, {"messages": messages}, DataConfig(train_on=train_on))
        assert sample["input_ids"].tolist() == template_ids(tokenizer, messages)
        assert tokenizer.decode(sample["input_ids"]).endswith("Second answer.<|end|>\n<|endoftext|>")
        assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == runs


def test_an_empty_system_message_is_kept_as_the_template_renders_it(tmp_path):
    empty = [{"role": "system", "content": ""}] + FIRST
    phi = family_tokenizer("phi3_5_mini")  # leaves an empty system message out
    sample = sample_of(tmp_path, "phi3_5_mini", {"messages": empty})
    assert phi.decode(sample["input_ids"]) == "<|user|>\nHello?<|end|>\n<|assistant|>\nHi there!<|end|>\n<|endoftext|>"
    assert label_runs(phi, sample["input_ids"], sample["labels"]) == ["Hi there!<|end|>"]
    qwen = family_tokenizer("qwen2_5")  # renders it, in place of its default system prompt
    sample = sample_of(tmp_path, "qwen2_5", {"messages": empty})
    assert qwen.decode(sample["input_ids"]).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHello?")
    assert label_runs(qwen, sample["input_ids"], sample["labels"]) == ["Hi there!<|im_end|>"]


@pytest.mark.parametrize("train_on", ["assistant", "last"])
def test_a_forced_think_prefix_in_the_generation_prompt_still_gives_exact_labels(tmp_path, train_on):
    tokenizer = family_tokenizer("deepseek_r1_distill_qwen")
    messages = FIRST + SECOND
    assert tokenizer.apply_chat_template(FIRST[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<｜Assistant｜><think>\n")
    sample = sample_of(tmp_path, "deepseek_r1_distill_qwen", {"messages": messages}, DataConfig(train_on=train_on))
    assert sample["input_ids"].tolist() == template_ids(tokenizer, messages)
    runs = ["Hi there!<｜end▁of▁sentence｜>", "Second answer.<｜end▁of▁sentence｜>"]
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == (runs if train_on == "assistant"
                                                                             else runs[1:])


def test_mistral_v0_3_trains_exactly_without_a_system_message_and_names_the_fix_with_one(tmp_path):
    tokenizer = family_tokenizer("mistral_v0_3")
    plain = sample_of(tmp_path, "mistral_v0_3", {"messages": FIRST + SECOND})
    assert plain["input_ids"].tolist() == template_ids(tokenizer, FIRST + SECOND)
    assert label_runs(tokenizer, plain["input_ids"], plain["labels"]) == [" Hi there!</s>", " Second answer.</s>"]
    for train_on in ("assistant", "last", "all"):  # its rendering of a finished chat has no system prompt at all
        dropped = sample_of(tmp_path, "mistral_v0_3", {"messages": [SYSTEM] + FIRST}, DataConfig(train_on=train_on))
        assert dropped["skip"] == "template_mismatch", train_on
        assert "drops the system message ('You are terse.')" in dropped["detail"]
        assert "set system_message to 'fold' in the data config" in dropped["detail"]
    assert "You are terse." not in tokenizer.apply_chat_template([SYSTEM] + FIRST, tokenize=False)
    moved = sample_of(tmp_path, "mistral_v0_3", {"messages": [SYSTEM] + FIRST + SECOND[:1]})  # a user turn last
    assert moved["skip"] == "template_mismatch"
    assert "shows the system message only while a user turn is last" in moved["detail"]
    assert "set train_on in the data config to 'all'" in moved["detail"]
    assert "or set system_message to 'fold'" in moved["detail"]
    every = sample_of(tmp_path, "mistral_v0_3", {"messages": [SYSTEM] + FIRST + SECOND[:1]}, DataConfig(train_on="all"))
    assert tokenizer.decode(every["input_ids"]) == "<s>[INST] Hello?[/INST] Hi there!</s>[INST] You are terse.\n\n" \
                                                   "And again?[/INST]"
    assert (every["labels"] == every["input_ids"]).all()


def test_the_tools_reach_the_template_in_encode_chat():
    tokenizer = family_tokenizer("qwen2_5_tools")
    with_tools = encode_chat(tokenizer, TOOL_CHAT, tools=TOOLS)
    without = encode_chat(tokenizer, TOOL_CHAT)
    assert "# Tools" in with_tools.text and "# Tools" not in without.text
    assert with_tools.input_ids == template_ids(tokenizer, TOOL_CHAT, tools=TOOLS)


def test_a_turn_that_only_calls_tools_reaches_qwen3_s_template_with_empty_content(tmp_path):
    """``content: null`` beside tool calls (the OpenAI shape): transformers drops None keys and Qwen3's
    template reads the content, so odb passes ``""``: the tokens of the template's own rendering of that."""
    tokenizer = family_tokenizer("qwen3")
    nulled = [QWEN3_TOOL_CHAT[0], {**QWEN3_TOOL_CHAT[1], "content": None}, *QWEN3_TOOL_CHAT[2:]]
    sample = sample_of(tmp_path, "qwen3", {"messages": nulled, "tools": TOOLS})
    assert "skip" not in sample, sample.get("detail")
    assert sample["input_ids"].tolist() == template_ids(tokenizer, QWEN3_TOOL_CHAT, tools=TOOLS)
    assert label_runs(tokenizer, sample["input_ids"], sample["labels"]) == TOOL_RUNS["qwen3"][1]


def test_openai_string_arguments_are_trained_as_the_json_object_not_double_encoded(tmp_path):
    """The OpenAI wire format gives ``arguments`` as a JSON string; the stock templates ``tojson``
    them, so a string would be trained as ``"{\\"city\\": \\"Paris\\"}"``."""
    tokenizer = family_tokenizer("qwen2_5_tools")
    wire = {**CALL, "function": {**CALL["function"], "arguments": json.dumps({"city": "Paris"})}}
    messages = [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": [wire]}, *TOOL_CHAT[2:]]
    sample = sample_of(tmp_path, "qwen2_5_tools", {"messages": messages, "tools": TOOLS})
    assert sample["input_ids"].tolist() == template_ids(tokenizer, TOOL_CHAT, tools=TOOLS)
    runs = label_runs(tokenizer, sample["input_ids"], sample["labels"])
    assert runs == TOOL_RUNS["qwen2_5_tools"][1] and '\\"' not in runs[0]


@pytest.mark.parametrize("family, messages, field", [
    ("qwen2_vl", TOOL_CHAT, "tool calls"),
    ("llama3", TOOL_CHAT, "tool calls"),
    ("phi3_mini", TOOL_CHAT, "tool calls"),
    ("qwen2_5", [FIRST[0], {**FIRST[1], "reasoning_content": "I should greet."}], "reasoning"),
])
def test_a_template_without_tool_or_reasoning_support_skips_the_record_naming_the_field(tmp_path, family, messages,
                                                                                         field):
    """Before, a tool-call turn on such a template trained as an empty answer (``<|im_end|>`` alone)."""
    tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
    sample = sample_of(tmp_path, family, {"messages": messages, **({"tools": tools} if tools else {})})
    assert sample.get("skip") == "template_drops_fields", sample.get("detail", sample.keys())
    assert field in sample["detail"] and "--tokenizer" in sample["detail"]
