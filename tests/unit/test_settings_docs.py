"""Each setting is written once: the run's flags, their defaults and help come from the settings
dataclasses, and docs/settings.md's tables from both."""

import dataclasses
from pathlib import Path

import pytest

from conftest import ROOT
from odb.batching.config import OdbConfig, load_odb_config
from odb.data.processing import DataConfig
from odb.settings import field_docs, flag_fields, flag_name
from odb.training import backends
from odb.training.config.optimization import DEMO_LR, FULL_LR, LORA_LR, OptimizationSettings
from odb.training.config.settings import CheckpointSettings, DataSettings, LoggingSettings, ModelSettings, RunSettings
from odb.training.launch.flags import FileDefaults, parse_config, parser
from odb.training.launch.settings_docs import BEGIN, END, settings_tables

FROM_FILES = {ModelSettings: {"lora"}, DataSettings: {"processing", "sources", "eval_sources"},
              OptimizationSettings: set(backends.NAMES), OdbConfig: {"pad_rows"}}
"""Fields read from a settings file rather than a flag of their own (odb's pad_rows: the trainer's; a
mixture's sources: --data's and --eval_data's words)."""
SETTINGS = (ModelSettings, DataSettings, OptimizationSettings, RunSettings, CheckpointSettings, LoggingSettings,
            OdbConfig)


def test_the_settings_page_holds_the_tables_the_code_makes():
    page = (ROOT / "docs" / "settings.md").read_text()
    region = page.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert region == settings_tables(ROOT), \
        "docs/settings.md drifted from the code: python tools/make/settings_tables.py"


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_every_setting_is_a_flag_with_its_fields_docstring_as_help(cls):
    actions = {a.option_strings[0]: a for a in parser(FileDefaults.bundled(ROOT))._actions if a.option_strings}
    for f in flag_fields(cls, skip=FROM_FILES.get(cls, ())):
        action = actions.get(flag_name(f))
        assert action is not None, f"{cls.__name__}.{f.name} has no flag"
        assert action.help.startswith(field_docs(cls).get(f.name, "")), f"{flag_name(f)}: {action.help!r}"


def test_a_run_without_flags_gets_the_dataclass_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (runs/default is created here)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = parse_config([], defaults=FileDefaults.bundled(ROOT))
    assert config.run == RunSettings()
    assert config.checkpoints == CheckpointSettings()
    assert config.logging == LoggingSettings()
    assert config.batching == load_odb_config(ROOT / "configs" / "odb.json")
    assert config.data.processing == DataConfig()
    assert config.optimization.lr == DEMO_LR  # the bundled tiny model's (the others: below)
    for cls, settings in ((OptimizationSettings, config.optimization), (DataSettings, config.data),
                          (ModelSettings, config.model)):
        for f in flag_fields(cls, skip=FROM_FILES.get(cls, ())):
            if f.default is not dataclasses.MISSING and f.name != "lr":
                assert getattr(settings, f.name) == f.default, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("lora", [False, True])
def test_a_model_of_one_s_own_gets_the_real_run_defaults(tmp_path, monkeypatch, lora):
    """Not the CPU demo's: the learning rate of its method, and the recipes' odb settings (a
    measured budget) unless --odb_config names a file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text((ROOT / "configs" / "tiny_model.json").read_text())
    config = parse_config(["--model", str(folder), *(["--lora"] if lora else [])], defaults=FileDefaults.bundled(ROOT))
    assert config.optimization.lr == (LORA_LR if lora else FULL_LR) and OptimizationSettings().lr == FULL_LR
    assert config.batching == load_odb_config(ROOT / "configs" / "recipes" / "odb.json")
    assert config.batching.max_tokens == "auto"
    given = parse_config(["--model", str(folder), "--lr", "3e-4", "--odb_config", str(ROOT / "configs" / "odb.json")],
                         defaults=FileDefaults.bundled(ROOT))
    assert given.optimization.lr == 3e-4 and given.batching.max_tokens == 2048


def test_batching_and_data_flags_override_their_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = tmp_path / "data.json"
    data.write_text('{"train_on": "last", "strict": true}')
    config = parse_config(["--max_tokens", "4096", "--seed", "3", "--data_config", str(data),
                           "--no-strict", "--data_format", "messages", "--loss_chunk_tokens", "0",
                           "--wandb_tags", "a,b", "--no_final_checkpoint"], defaults=FileDefaults.bundled(ROOT))
    file = load_odb_config(ROOT / "configs" / "odb.json")
    assert config.batching == dataclasses.replace(file, max_tokens=4096, seed=3)
    assert config.data.processing == DataConfig(train_on="last", strict=False, format="messages")
    assert config.model.loss_chunk_tokens is None and config.logging.wandb_tags == ("a", "b")
    assert config.checkpoints.final is False


def test_bundled_defaults_name_files_that_exist():
    defaults = FileDefaults.bundled(ROOT)
    for f in dataclasses.fields(defaults):
        assert Path(getattr(defaults, f.name)).exists(), f.name
