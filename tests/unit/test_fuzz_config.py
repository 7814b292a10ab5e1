"""Bad input wherever a user can type: every JSON config loader and the command line, fuzzed.

The property, for each: the input either loads into a valid config, or fails with ``ValueError`` /
``FileNotFoundError`` (``SystemExit`` from argparse, its usage line on stderr) whose message names
the key or flag at fault (or the file it sits in); never a ``TypeError``, ``AttributeError``,
``RecursionError``... from deep inside. The values: every JSON type for every known key (strings,
floats with NaN and infinities, booleans, null, lists, objects, negative and huge integers),
unknown keys, JSON that is not an object, text that is not JSON, missing files and folders, and
command lines of the real flags with bad values and contradicting combinations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from conftest import train_defaults
from odb.batching.config import OdbConfig, load_odb_config
from odb.data.processing import DataConfig, load_data_config
from odb.settings import load_json_config
from odb.training.backends import fsdp2
from odb.training.backends.deepspeed_config import load_ds_config, resolve_ds_config
from odb.training.config.lora import lora_keys
from odb.training.config.optimization import Fsdp2Settings, OptimizationSettings
from odb.training.config.settings import (
    CheckpointSettings,
    DataSettings,
    LoggingSettings,
    ModelSettings,
    RunConfig,
    RunSettings,
)
from odb.training.launch.flags import parse_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DEFAULTS = train_defaults()
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_SCALARS = st.one_of(
    st.text(max_size=8), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, -1, 1, 2**63 - 1, 2**63, 2**64, 10**30]))
JSON_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3),
                        st.dictionaries(st.text(max_size=4), _SCALARS, max_size=3))
"""Any JSON value: mostly of the wrong type for whatever key it lands on."""
NON_OBJECTS = JSON_VALUES.filter(lambda value: not isinstance(value, dict))


@pytest.fixture(scope="module", autouse=True)
def _one_process():
    with pytest.MonkeyPatch.context() as patch:  # parse_config reads the launcher's WORLD_SIZE
        patch.delenv("WORLD_SIZE", raising=False)
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _write(path: Path, values: Any) -> Path:
    path.write_text(json.dumps(values))  # NaN and infinities as JSON's NaN / Infinity, which json reads back
    return path


def _names_one_of(message: str | BaseException, names: list[str]) -> None:
    assert any(name in str(message) for name in names), f"{message!r} names none of {names}"


_IS_A = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63,
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "None": lambda v: v is None,
    "tuple[str, ...]": lambda v: isinstance(v, tuple) and all(isinstance(item, str) for item in v),
}


def _holds_its_declared_types(config: Any) -> None:
    """Every field of a config that loaded holds a value of its annotation (``int | None``, ...):
    an oracle that does not share the validation code."""
    for f in dataclasses.fields(config):
        value, kinds = getattr(config, f.name), f.type.split(" | ")
        if all(kind in _IS_A for kind in kinds):
            assert any(_IS_A[kind](value) for kind in kinds), f"{f.name}: {f.type} holds {value!r}"


def _lora(path: Path) -> ModelSettings:
    lora = load_json_config(path, known=lora_keys(), what="LoRA config", fix="pass --lora configs/lora.json")
    return ModelSettings(path="model", tokenizer="tokenizer", lora=lora)


def _ds(path: Path) -> dict[str, Any]:
    return resolve_ds_config(load_ds_config(path), gas=2, world_size=3, use_bf16=True)


LOADERS = {  # name -> (load a path, its flag, the valid file to start from, its known keys)
    "odb": (load_odb_config, "--odb_config", CONFIGS / "odb.json", OdbConfig.field_names()),
    "data": (load_data_config, "--data_config", CONFIGS / "data.json",
             [f.name for f in dataclasses.fields(DataConfig)]),
    "lora": (_lora, "--lora", CONFIGS / "lora.json", None),  # (peft's keys, read when first needed)
    "deepspeed": (_ds, "--deepspeed_config", CONFIGS / "ds_zero2.json", None),
    "fsdp2": (partial(fsdp2.load_settings, gas=1, world_size=1, use_bf16=True), "--fsdp_config", CONFIGS / "fsdp2.json",
              [f.name for f in dataclasses.fields(Fsdp2Settings)]),
}


# ---- one loader at a time: wrong types for known keys --------------------------------------------

_ODB_VALID = st.one_of(st.sampled_from(["join", "quota", "truncate", "drop", "error", "dynamic", "static", "odb",
                                        "fixed", "gmt", "bmt"]), st.integers(0, 600), st.floats(0, 1))
"""Valid values too, so that combinations (quota mode, baseline policies) are reached."""


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(OdbConfig.field_names()), st.one_of(JSON_VALUES, _ODB_VALID),
                               min_size=1, max_size=3))
@example(changes={"attn_coef": "0.5"}).via("TypeError before")
@example(changes={"min_fill": None}).via("TypeError before")
@example(changes={"patch_coef": float("nan")}).via("accepted before")
@example(changes={"seed": -1}).via("accepted before; numpy refused it at the first epoch")
@example(changes={"mode": "quota", "quota": 2**64}).via("accepted before; past the int64 ranks exchange")
def test_odb_config_values(folder, changes):
    values = json.loads((CONFIGS / "odb.json").read_text()) | changes
    path = _write(folder / "odb.json", values)
    try:
        config = load_odb_config(path)
    except ValueError as err:
        _names_one_of(err, [f"--{key}" for key in changes])
    else:
        _holds_its_declared_types(config)
        assert dataclasses.replace(config) == config  # (validated again)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(DataConfig)]),
                               st.one_of(JSON_VALUES, st.sampled_from(["auto", "llava", "last", "tokens"])),
                               min_size=1, max_size=3))
@example(changes={"system_prompts": 3}).via("TypeError before")
@example(changes={"system_prompts": "Be brief."}).via("before: one prompt per character")
@example(changes={"min_pixels": "3136"}).via("TypeError before")
@example(changes={"strict": "no"}).via("accepted before, and true")
def test_data_config_values(folder, changes):
    values = json.loads((CONFIGS / "data.json").read_text()) | changes
    path = _write(folder / "data.json", values)
    try:
        config = load_data_config(path)
    except ValueError as err:
        _names_one_of(err, list(changes))
    else:
        _holds_its_declared_types(config)
        assert dataclasses.replace(config) == config


_LORA_TYPED = ["r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "modules_to_save",
               "target_parameters", "layers_to_transform", "bias", "init_lora_weights", "rank_pattern",
               "alpha_pattern", "fan_in_fan_out", "inference_mode", "use_dora", "use_rslora"]
"""The LoRA keys odb checks the shape of; the rest are peft's to check."""


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=32))


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:You have passed exclude_modules:UserWarning")
@FUZZ
@given(changes=st.dictionaries(st.sampled_from(_LORA_TYPED), st.one_of(
    JSON_VALUES, st.sampled_from(["q_proj", ["v_proj"], "all-linear", "gaussian", [0], 1])), min_size=1, max_size=2))
@example(changes={"r": "8"}).via("accepted before; TypeError when peft divided lora_alpha by it")
@example(changes={"lora_dropout": 2.0}).via("accepted before")
@example(changes={"modules_to_save": 1}).via("accepted before; TypeError in get_peft_model")
@example(changes={"rank_pattern": None}).via("accepted before; AttributeError in get_peft_model")
def test_lora_values_that_load_build_a_peft_model(folder, changes):
    from peft import LoraConfig, get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    values = json.loads((CONFIGS / "lora.json").read_text()) | changes
    path = _write(folder / "lora.json", values)
    try:
        lora = _lora(path).lora
    except ValueError as err:
        _names_one_of(err, [f"'{key}'" for key in changes])
        return
    try:
        get_peft_model(_tiny_llama(), LoraConfig(task_type="CAUSAL_LM", **lora))
    except NoMatchingPeftModuleError:  # names that match no module of this model: peft's own error, at build
        pass


@pytest.mark.filterwarnings("ignore:`.*` specified but will be ignored:UserWarning")  # (peft's, on odd keys)
@FUZZ
@given(changes=st.dictionaries(st.deferred(lambda: st.sampled_from(lora_keys())), JSON_VALUES, min_size=1,
                               max_size=2))
def test_lora_any_key(folder, changes):
    path = _write(folder / "lora.json", json.loads((CONFIGS / "lora.json").read_text()) | changes)
    try:
        _lora(path)
    except ValueError as err:
        _names_one_of(err, [f"'{key}'" for key in changes])


_DS_KEYS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "scheduler",
            "bf16", "bfloat16", "fp16", "zero_optimization", "gradient_clipping"]


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(_DS_KEYS), st.one_of(
    JSON_VALUES, st.sampled_from(["auto", 1, 2, 6]), st.fixed_dictionaries({"enabled": JSON_VALUES}),
    st.fixed_dictionaries({"stage": JSON_VALUES})), min_size=1, max_size=3),
    gas=st.integers(1, 8), world_size=st.integers(1, 8))
@example(changes={"bf16": True}, gas=1, world_size=1).via("accepted before; AttributeError in the trainer")
@example(changes={"zero_optimization": None}, gas=1, world_size=1).via("accepted before; AttributeError")
@example(changes={"gradient_accumulation_steps": True}, gas=1, world_size=1).via("accepted before")
def test_deepspeed_config_values(folder, changes, gas, world_size):
    values = json.loads((CONFIGS / "ds_zero2.json").read_text()) | changes
    path = _write(folder / "ds.json", values)
    try:
        out = resolve_ds_config(load_ds_config(path), gas=gas, world_size=world_size, use_bf16=False)
    except ValueError as err:
        _names_one_of(err, list(changes))
    else:
        assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"],
                out["train_batch_size"]) == (1, gas, gas * world_size)
        for precision in ("bf16", "bfloat16", "fp16"):
            assert out.get(precision, {}).get("enabled", False) in (True, False)
        assert out.get("zero_optimization", {}).get("stage", 0) in (0, 1, 2, 3)


# ---- every loader: unknown keys, not an object, not JSON, no file --------------------------------

@FUZZ
@given(loader=st.sampled_from(["odb", "data", "lora"]), key=st.text(min_size=1, max_size=12))
def test_an_unknown_key_is_named_with_the_known_ones(folder, loader, key):
    load, _, valid, known = LOADERS[loader]
    known = known or lora_keys()
    if key in known:
        return
    path = _write(folder / f"{loader}.json", json.loads(valid.read_text()) | {key: 1})
    with pytest.raises(ValueError, match=r"unknown key\(s\)") as err:
        load(path)
    assert repr(key) in str(err.value) and repr(known[0]) in str(err.value)


@FUZZ
@given(loader=st.sampled_from(sorted(LOADERS)), value=NON_OBJECTS)
def test_json_that_is_not_an_object_names_the_file_and_the_flag(folder, loader, value):
    load, flag, _, _ = LOADERS[loader]
    path = _write(folder / f"{loader}.json", value)
    with pytest.raises(ValueError, match="must hold a JSON object") as err:
        load(path)
    _names_one_of(err.value, [flag])
    assert str(path) in str(err.value)


@FUZZ
@given(loader=st.sampled_from(sorted(LOADERS)),
       content=st.one_of(st.text(max_size=40), st.binary(max_size=40), st.sampled_from([
           b"", b" \n", b"{", b'{"a": 1,}', b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"[" * 100_000, b"1" * 5_000,
           b'{"max_tokens": ' + b"9" * 5_000 + b"}", b"NaN", b"{'single': 'quotes'}"])))
@example(loader="odb", content=b"\xff\xfe{}").via("UnicodeDecodeError before")
@example(loader="odb", content=b"[" * 100_000).via("RecursionError before")
@example(loader="deepspeed", content=b"1" * 5_000).via("ValueError without the file's name before")
def test_any_file_content(folder, loader, content):
    load, flag, _, _ = LOADERS[loader]
    path = folder / f"{loader}.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    try:
        load(path)
    except ValueError as err:
        try:
            loaded = json.loads(path.read_bytes())
        except (ValueError, RecursionError):
            loaded = None
        if isinstance(loaded, dict):  # an object: one of its keys is at fault
            _names_one_of(err, [str(path), *loaded])
        else:  # not JSON, or not an object: the file and its flag
            _names_one_of(err, [str(path)])
            _names_one_of(err, [flag])


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("where", ["missing", "folder"])
def test_no_file_names_the_flag(tmp_path, loader, where):
    load, flag, _, _ = LOADERS[loader]
    path = tmp_path / "missing.json" if where == "missing" else tmp_path
    with pytest.raises(FileNotFoundError, match=flag) as err:
        load(path)
    assert str(path) in str(err.value)


# ---- the run config's groups ---------------------------------------------------------------------

GROUPS = {  # group -> (required fields, {field: the flag an error must name})
    ModelSettings: ({"path": "m", "tokenizer": "t"},
                    {"path": "--model", "tokenizer": "--tokenizer", "lora": "--lora"}),
    RunSettings: ({}, {}),
    DataSettings: ({"path": "d"}, {"path": "--data", "processing": "--data_config", "eval_path": "--eval_data",
                                   "sources": "--data", "eval_sources": "--eval_data"}),
    OptimizationSettings: ({}, {"deepspeed": "--deepspeed_config", "fsdp2": "--fsdp_config"}),
    Fsdp2Settings: ({}, {f.name: "--fsdp_config" for f in dataclasses.fields(Fsdp2Settings)}),
    CheckpointSettings: ({}, {"final": "--no_final_checkpoint"}),
    LoggingSettings: ({}, {}),
}
_GROUP_FIELDS = [(group, f.name) for group in GROUPS for f in dataclasses.fields(group)]


@FUZZ
@given(field=st.sampled_from(_GROUP_FIELDS), value=JSON_VALUES)
@example(field=(RunSettings, "epochs"), value="2").via("TypeError before")
@example(field=(OptimizationSettings, "lr"), value=float("nan")).via("accepted before")
@example(field=(OptimizationSettings, "weight_decay"), value=-0.1).via(
    "accepted before; torch refused it after the process group was joined")
@example(field=(LoggingSettings, "wandb_tags"), value="a,b").via("before: tags 'a', ',', 'b'")
@example(field=(RunSettings, "dist_timeout_s"), value=10**20).via("accepted before; OverflowError in timedelta")
def test_run_config_groups(field, value):
    group, name = field
    required, flags = GROUPS[group]
    try:
        settings_ = group(**(required | {name: value}))
    except ValueError as err:
        _names_one_of(err, [flags.get(name, f"--{name}")])
    else:
        _holds_its_declared_types(settings_)
        assert dataclasses.replace(settings_) == settings_  # (validated again)


# ---- the command line ----------------------------------------------------------------------------

_INT_FLAGS = ["--eval_steps", "--epochs", "--max_samples", "--max_steps", "--seed", "--loss_chunk_tokens",
              "--save_steps", "--save_total_limit", "--num_workers", "--prefetch_factor", "--dist_timeout_s",
              "--local_rank"]
_FLOAT_FLAGS = ["--val_ratio", "--lr", "--warmup_ratio", "--weight_decay"]
_TEXT_FLAGS = ["--backend", "--data_format", "--optimizer", "--report_to", "--wandb_project", "--run_name",
               "--wandb_tags", "--resume"]
_PATH_FLAGS = ["--deepspeed_config", "--fsdp_config", "--odb_config", "--model", "--tokenizer", "--data",
               "--data_config", "--eval_data", "--lora", "--output_dir"]
_SWITCHES = ["--strict", "--gradient_checkpointing", "--no_final_checkpoint", "--save_hf", "--save_adapter_only",
             "--audit_ids", "--lora", "--resume"]
_NUMBERS = st.one_of(st.integers(-10**25, 10**25).map(str), st.floats().map(repr), st.text(max_size=6),
                     st.sampled_from(["0", "-1", "1", "2", "0.5", "nan", "inf", "-inf", "", "1e400", "0x10", "１"]))
_MADE = {"bad.json": "{not json", "list.json": "[1, 2]", "empty.json": "", "output_file": "",
         "model_without_type.json": '{"hidden_size": 8}'}
"""Files a test makes in its folder (``{folder}`` in a path value)."""
_PATHS = [*map(str, sorted(CONFIGS.glob("*.json"))),
          *(str(ROOT / "data" / name) for name in ("chat.jsonl", "tokenizer", "mm/train.jsonl", "")),
          *(f"{{folder}}/{name}" for name in [*_MADE, "missing.json", "run"]), "", "{folder}"]
"""What a user might pass to any path flag: right files, the wrong kind, broken ones, none at all."""
_FLAG_VALUES = st.one_of(
    st.tuples(st.sampled_from(_INT_FLAGS + _FLOAT_FLAGS), _NUMBERS),
    st.tuples(st.sampled_from(_TEXT_FLAGS), st.one_of(st.text(max_size=8), st.sampled_from(
        ["messages", "sharegpt", "llava", "auto", "sgd", "adamw", "wandb", "none", "latest", "step1", "fsdp2",
         "deepspeed"]))),
    st.tuples(st.sampled_from(_PATH_FLAGS), st.sampled_from(_PATHS)),
    st.tuples(st.sampled_from(_SWITCHES), st.none()))


@FUZZ
@given(pairs=st.lists(_FLAG_VALUES, min_size=1, max_size=4))
@example(pairs=[("--model", "{folder}/model_without_type.json")]).via("accepted before; TypeError at build")
@example(pairs=[("--tokenizer", str(CONFIGS / "odb.json"))]).via("accepted before; transformers failed at build")
@example(pairs=[("--lora", str(CONFIGS / "odb.json"))]).via("unknown keys, naming the file")
@example(pairs=[("--lr", "nan")]).via("accepted before")
@example(pairs=[("--seed", "-1")]).via("accepted before; numpy refused it at the first epoch")
@example(pairs=[("--output_dir", "{folder}/output_file")]).via("accepted before; FileExistsError later")
@example(pairs=[("--eval_data", "")]).via("before: the current folder as validation data")
@example(pairs=[("--save_adapter_only", None), ("--save_hf", None)]).via("contradiction: no --lora")
@example(pairs=[("--eval_steps", "3")]).via("contradiction: no validation data")
@example(pairs=[("--fsdp_config", str(CONFIGS / "fsdp2.json"))]).via("contradiction: no --backend fsdp2")
@example(pairs=[("--backend", "fsdp2"), ("--deepspeed_config", str(CONFIGS / "ds_zero2.json"))]).via("contradiction")
@example(pairs=[("--val_ratio", "0.2"), ("--eval_data", str(ROOT / "data" / "chat.jsonl"))]).via("contradiction")
def test_command_line(folder, pairs):
    for name, text in _MADE.items():
        (folder / name).write_text(text)
    pairs = [(flag, value if value is None else value.replace("{folder}", str(folder))) for flag, value in pairs]
    argv = [item for flag, value in pairs for item in ((flag,) if value is None else (flag, value))]
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(folder / "run")]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            config = parse_config(argv, defaults=DEFAULTS)
    except SystemExit:
        event("argparse refused")
        _names_one_of(stderr.getvalue(), [flag for flag, _ in pairs])
    except (ValueError, FileNotFoundError) as err:
        event(type(err).__name__)
        paths = [value for flag, value in pairs if flag in _PATH_FLAGS and value]
        _names_one_of(err, [flag for flag, _ in pairs] + paths)  # (a file's own error names the file)
    else:
        event("parsed")
        assert isinstance(config, RunConfig)
        for group in (config.model, config.data, config.data.processing, config.batching, config.optimization,
                      config.run, config.checkpoints, config.logging):
            _holds_its_declared_types(group)
        json.dumps(config.to_dict(), allow_nan=False)  # every value plain and finite


@pytest.mark.parametrize("world_size", ["abc", "0", "-2", "", "1.5"])
def test_a_bad_world_size_names_the_variable(monkeypatch, tmp_path, world_size):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    fresh = ["--output_dir", str(tmp_path / "run")]  # (not runs/default, which a README run may have filled)
    with pytest.raises(ValueError, match=f"WORLD_SIZE must be an integer >= 1, got '{world_size}'"):
        parse_config(fresh, defaults=DEFAULTS)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_config(fresh, defaults=DEFAULTS).optimization.deepspeed["train_batch_size"] == 4
