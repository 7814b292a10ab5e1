"""configs/recipes/: each recipe script's command line, run with its launcher replaced by a
script that reads the flags as launch/train.py does (odb.training.cli.parse_config, every file
checked) and prints the resolved config, on the bundled tiny models: the flags are valid, and
each recipe has what it says (a measured budget, gradient checkpointing, its method's learning
rate, overlapped communication, evaluation and export). The GPUs they are sized for are not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SHOW = """
import json, sys
sys.path.insert(0, {root!r})
from odb.training.cli import FileDefaults, parse_config
config = parse_config(sys.argv[2:], defaults=FileDefaults.bundled(__import__("pathlib").Path({root!r})))
print("CONFIG " + json.dumps(config.to_dict()))
"""

RECIPES = {  # recipe: (model, lr, lora, backend)
    "qwen2.5-7b-full.sh": ("configs/tiny_model.json", 2e-5, False, "deepspeed"),
    "llama3-8b-lora.sh": ("configs/tiny_model.json", 2e-4, True, "deepspeed"),
    "qwen2.5-vl-7b.sh": ("configs/tiny_vl_model.json", 1e-5, False, "deepspeed"),
    "llama3-70b-fsdp2-slurm.sh": ("configs/tiny_model.json", 1e-5, False, "fsdp2"),
}


def test_every_recipe_is_tested():
    assert sorted(RECIPES) == sorted(p.name for p in (ROOT / "configs" / "recipes").glob("*.sh"))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_s_flags_resolve_to_what_it_promises(tmp_path, recipe):
    model, lr, lora, backend = RECIPES[recipe]
    show = tmp_path / "show.py"
    show.write_text(SHOW.format(root=str(ROOT)))
    env = {**os.environ, "LAUNCHER": f"{sys.executable} {show}", "WORLD_SIZE": "8"}
    done = subprocess.run(["bash", str(ROOT / "configs" / "recipes" / recipe), str(ROOT / model),
                           str(ROOT / "data" / "chat.jsonl"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads(done.stdout.split("CONFIG ", 1)[1])
    assert config["batching"]["max_tokens"] == "auto" and config["preflight"]["preflight"] == "on"
    assert config["model"]["gradient_checkpointing"] and config["optimization"]["lr"] == lr
    assert (config["model"]["lora"] is not None) == lora
    assert config["optimization"]["backend"] == backend
    assert config["data"]["val_ratio"] > 0 and config["data"]["eval_steps"] > 0 and config["checkpoints"]["save_hf"]
    if backend == "deepspeed":
        assert config["optimization"]["deepspeed"]["zero_optimization"]["overlap_comm"] is True
    else:
        assert config["optimization"]["fsdp2"]["reduce_every_micro_batch"] is True
