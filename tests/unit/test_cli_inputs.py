"""Inputs that cannot run, refused while launch/train.py parses its flags (odb/training/launch/flags.py's
``parse_config``, which every rank runs before any process group), with a message that names the
fix. (tests/e2e/test_train.py launches the script with such an input, on one process and on two
ranks: the message reaches stderr and every rank ends.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import train_defaults
from odb.training.launch.flags import parse_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = train_defaults()


@pytest.fixture(autouse=True)
def _in_the_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the relative paths below, as a user in the checkout types them
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("flag,value,needle", [
    ("--odb_config", "configs/nope.json", "odb config configs/nope.json does not exist; pass --odb_config"),
    ("--deepspeed_config", "configs/nope.json", "DeepSpeed config configs/nope.json does not exist"),
    ("--model", "models/missing", "model models/missing does not exist; pass a local HF model folder"),
    ("--model", "data", "model folder data has no config.json"),
    ("--data", "data/missing.jsonl", "data path data/missing.jsonl does not exist"),
])
def test_a_bad_path_names_the_flag(tmp_path, flag, value, needle):
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(needle)):
        parse_config([flag, value, "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)


@pytest.mark.parametrize("flag,what", [("--odb_config", "odb config"), ("--data_config", "data config"),
                                       ("--lora", "LoRA config")])
def test_every_json_config_refuses_a_key_it_does_not_know(tmp_path, flag, what):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"windw": 8}))
    with pytest.raises(ValueError, match=re.escape(f"{what} {path}: unknown key(s) ['windw']; known keys are [")):
        parse_config([flag, str(path), "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)


def test_a_deepspeed_config_with_a_scheduler_is_refused(tmp_path):
    """odb sets the learning rate by progress over the samples; a DeepSpeed scheduler would set it again."""
    path = tmp_path / "sched.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupLR"}}))
    with pytest.raises(ValueError, match='remove "scheduler"'):
        parse_config(["--deepspeed_config", str(path), "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)
