"""configs/recipes/: each model recipe read as its ranks read it (odb.training.launch.flags.parse_config,
every file checked) on the bundled tiny models, as a job of 8 ranks: the keys are valid, and each
recipe has what it says (a measured budget, gradient checkpointing, its method's learning rate,
overlapped communication, evaluation and export, its launch). The GPUs they are sized for are not
here. (That a recipe equals the flags it stands for: tests/unit/test_recipe.py.)"""

from __future__ import annotations

import pytest

from conftest import ROOT, train_defaults
from odb.recipe import load_recipe, recipe_names
from odb.training.launch.flags import parse_config

RECIPES = {  # recipe: (model, lr, lora, backend, nproc on one node; None: SLURM's tasks)
    "qwen2.5-7b-full": ("configs/tiny_model.json", 2e-5, False, "deepspeed", 8),
    "llama3-8b-lora": ("configs/tiny_model.json", 2e-4, True, "deepspeed", 8),
    "qwen2.5-vl-7b": ("configs/tiny_vl_model.json", 1e-5, False, "deepspeed", 8),
    "llama3-70b-fsdp2-slurm": ("configs/tiny_model.json", 1e-5, False, "fsdp2", None),
    "qwen2.5-7b-dpo-lora": ("configs/tiny_model.json", 5e-5, True, "deepspeed", 8),
    "qwen2.5-7b-reward-lora": ("configs/tiny_model.json", 1e-4, True, "deepspeed", 8),
}


def test_every_recipe_is_tested():
    assert sorted([*RECIPES, "demo"]) == recipe_names(ROOT / "configs" / "recipes")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_resolves_to_what_it_promises(tmp_path, monkeypatch, name):
    model, lr, lora, backend, nproc = RECIPES[name]
    monkeypatch.setenv("WORLD_SIZE", "8")
    recipe = load_recipe(name, folder=ROOT / "configs" / "recipes",
                         overrides=[f"model={ROOT / model}", f"data={ROOT / 'data' / 'chat.jsonl'}",
                                    f"output_dir={tmp_path / 'out'}"])
    config = parse_config([], defaults=train_defaults(), recipe=recipe).to_dict()
    assert config["batching"]["max_tokens"] == "auto" and config["preflight"]["preflight"] == "on"
    assert config["model"]["gradient_checkpointing"] and config["optimization"]["lr"] == lr
    assert (config["model"]["lora"] is not None) == lora
    assert config["optimization"]["backend"] == backend
    assert config["data"]["val_ratio"] > 0 and config["data"]["eval_steps"] > 0 and config["checkpoints"]["save_hf"]
    if backend == "deepspeed":
        assert config["optimization"]["deepspeed"]["zero_optimization"]["overlap_comm"] is True
    else:
        assert config["optimization"]["fsdp2"]["reduce_every_micro_batch"] is True
    assert recipe.get("nproc") == nproc
