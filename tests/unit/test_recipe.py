"""Recipes (odb/recipe.py) and the ``odb`` command (odb/cli/): a recipe resolves to the same
RunConfig as the flags it stands for (written out here by hand, with the settings files the
recipes held before they were YAML), overrides and flags win in that order, a bad key names the
file, the key and the nearest valid one, settings files are found next to the recipe or taken
inline, and ``odb train`` picks the launcher of the run's backend. No process is started."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import ROOT, train_defaults
from odb.batching.config import load_odb_config
from odb.cli import main as odb
from odb.cli import train as odb_train
from odb.cli.files import _absolute
from odb.recipe import bundled_root, find_recipe, load_recipe, parse_overrides
from odb.settings import read_yaml
from odb.training.launch.flags import SETTINGS_FILES, parse_config

RECIPES = ROOT / "configs" / "recipes"
DEFAULTS = train_defaults()
TINY = str(ROOT / "configs" / "tiny_model.json")
TINY_VL = str(ROOT / "configs" / "tiny_vl_model.json")
CHATS = str(ROOT / "data" / "chat.jsonl")

# What configs/recipes/*.sh passed to launch/train.py, and the JSON files beside them that the
# YAML recipes now hold inline (their contents as they were): the oracle the recipes must equal.
OLD_FILES = {
    "lora.json": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
                  "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "data_vl.json": {"format": "auto", "train_on": "assistant", "truncation": "turns", "min_pixels": 3136,
                     "max_pixels": 1003520},
    "fsdp2_70b.json": {"mixed_precision": "bf16", "reduce_dtype": "fp32", "reshard_after_forward": True,
                       "cpu_offload": False, "reduce_every_micro_batch": True, "gradient_clipping": 1.0},
    "ds_zero2.json": {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                      "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0, "bf16": {"enabled": "auto"},
                      "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                            "reduce_bucket_size": 500000000, "allgather_bucket_size": 500000000},
                      "steps_per_print": 1000000, "wall_clock_breakdown": False},
}
TAIL = ["--warmup_ratio", "0.03", "--epochs", "2", "--val_ratio", "0.02", "--eval_steps", "200",
        "--save_total_limit", "2", "--save_hf"]
OLD_FLAGS = {  # recipe: (its model here, the .sh's flags; {old} the folder of OLD_FILES, {recipes} configs/recipes)
    "qwen2.5-7b-full": (TINY, ["--deepspeed_config", "{recipes}/ds_zero3.json", "--odb_config", "{recipes}/odb.json",
                               "--gradient_checkpointing", "--lr", "2e-5", "--save_steps", "500", *TAIL]),
    "llama3-8b-lora": (TINY, ["--deepspeed_config", "{old}/ds_zero2.json", "--odb_config", "{recipes}/odb.json",
                              "--lora", "{old}/lora.json", "--gradient_checkpointing", "--lr", "2e-4",
                              "--save_steps", "500", *TAIL]),
    "qwen2.5-vl-7b": (TINY_VL, ["--data_config", "{old}/data_vl.json", "--deepspeed_config", "{recipes}/ds_zero3.json",
                                "--odb_config", "{recipes}/odb.json", "--max_patches", "auto",
                                "--gradient_checkpointing", "--lr", "1e-5", "--save_steps", "500", *TAIL]),
    "llama3-70b-fsdp2-slurm": (TINY, ["--backend", "fsdp2", "--fsdp_config", "{old}/fsdp2_70b.json",
                                      "--odb_config", "{recipes}/odb.json", "--gradient_checkpointing", "--lr", "1e-5",
                                      "--save_steps", "200", *TAIL]),
}


@pytest.fixture(autouse=True)
def _world(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # (relative paths are the working folder's; the recipe's files are not)
    monkeypatch.setenv("WORLD_SIZE", "8")
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)


def _old_files(folder: Path) -> Path:
    folder.mkdir()
    for name, values in OLD_FILES.items():
        (folder / name).write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("recipe", sorted(OLD_FLAGS))
def test_a_recipe_resolves_to_the_config_of_the_flags_it_stands_for(tmp_path, recipe):
    model, flags = OLD_FLAGS[recipe]
    old = _old_files(tmp_path / "old")
    run = ["--model", model, "--data", CHATS, "--output_dir", str(tmp_path / "out")]
    by_flags = parse_config([*run, *(f.format(old=old, recipes=RECIPES) for f in flags)], defaults=DEFAULTS)
    overrides = [f"model={model}", f"data={CHATS}", f"output_dir={tmp_path / 'out'}"]
    by_recipe = parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe, folder=RECIPES, overrides=overrides))
    assert by_recipe == by_flags
    assert json.dumps(by_recipe.to_dict()) == json.dumps(by_flags.to_dict())
    named = parse_config(["--recipe", recipe, *run], defaults=DEFAULTS)  # (launch/slurm.sbatch's way)
    assert named == by_flags


def test_the_dpo_recipe_trains_lora_dpo_against_its_base_model(tmp_path):
    overrides = [f"model={TINY}", f"data={ROOT / 'data' / 'preference.jsonl'}", f"output_dir={tmp_path / 'out'}"]
    config = parse_config([], defaults=DEFAULTS, recipe=load_recipe("qwen2.5-7b-dpo-lora", folder=RECIPES,
                                                                    overrides=overrides))
    objective = config.objective
    assert (objective.objective, objective.beta, objective.reference_for(lora=config.model.lora is not None)) == \
        ("dpo", 0.1, "adapter")
    assert config.model.lora["r"] == 16 and config.optimization.lr == 5e-5
    with pytest.raises(ValueError, match="train with --lora"):  # a full fine-tune has no adapter to disable
        parse_config(["--objective", "dpo", "--reference", "adapter", "--output_dir", str(tmp_path / "o")],
                     defaults=DEFAULTS)


def test_the_demo_recipe_is_the_readme_s_first_command(tmp_path):
    readme = (ROOT / "README.md").read_text()
    first = next(line for line in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)[0].splitlines()
                 if "launch/train.py" in line)
    flags = first.split("launch/train.py", 1)[1].split()
    assert flags == ["--deepspeed_config", "configs/ds_zero2.json", "--output_dir", "runs/default"]
    flags = [str(ROOT / f) if f.startswith("configs/") else f for f in flags]
    out = f"output_dir={tmp_path / 'o'}"
    by_flags = parse_config([*flags, "--output_dir", str(tmp_path / "o")], defaults=DEFAULTS)
    demo = load_recipe("demo", folder=RECIPES, overrides=[out])
    assert parse_config([], defaults=DEFAULTS, recipe=demo) == by_flags
    assert demo.get("nproc") == 2 and demo.path == RECIPES / "demo.yaml"


def test_overrides_win_over_the_recipe_and_flags_over_both(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 2.0e-5\nsave_hf: true\nepochs: 3\nwandb_tags: [a, b]\nstrict: true\n")
    out = f"output_dir={tmp_path / 'o'}"
    plain = parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe, overrides=[out]))
    assert (plain.optimization.lr, plain.checkpoints.save_hf, plain.run.epochs) == (2e-5, True, 3)
    assert plain.logging.wandb_tags == ("a", "b") and plain.data.processing.strict is True
    changed = parse_config([], defaults=DEFAULTS, recipe=load_recipe(
        recipe, overrides=[out, "lr=1e-4", "save_hf=false", "strict=false", "epochs=null"]))
    assert (changed.optimization.lr, changed.checkpoints.save_hf, changed.run.epochs) == (1e-4, False, 1)
    assert changed.data.processing.strict is False
    flagged = parse_config(["--recipe", str(recipe), "--lr", "3e-4", "--epochs", "5", "--output_dir",
                            str(tmp_path / "o")], defaults=DEFAULTS)
    assert (flagged.optimization.lr, flagged.run.epochs, flagged.checkpoints.save_hf) == (3e-4, 5, True)


def test_an_unknown_key_names_the_recipe_the_key_and_the_nearest_key(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("max_token: 4096\n")
    with pytest.raises(ValueError, match=re.escape(f"recipe {recipe}: unknown key 'max_token'; did you mean "
                                                   "'max_tokens'?")):
        parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe))
    recipe.write_text("lr: 1.0e-5\n")
    with pytest.raises(ValueError, match=re.escape("the command line: unknown key 'gradient_checkpoint'; did "
                                                   "you mean 'gradient_checkpointing'?")):
        parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe, overrides=["gradient_checkpoint=true"]))
    recipe.write_text("odb_config: {windw: 64}\n")  # inside an inline settings file: the strict loader
    with pytest.raises(ValueError, match=re.escape(f"odb config (recipe {recipe}: odb_config): unknown key(s) "
                                                   "['windw']; known keys are [")) as err:
        parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe, overrides=[f"output_dir={tmp_path / 'o'}"]))
    assert str(err.value).endswith("did you mean 'window' for 'windw'?")


def test_the_strict_loader_names_the_nearest_key_of_a_file(tmp_path):
    path = tmp_path / "odb.yaml"
    path.write_text("windw: 64\nmax_tokns: 512\nzzz: 1\n")
    with pytest.raises(ValueError, match=re.escape(f"odb config {path}: unknown key(s) ['max_tokns', 'windw', "
                                                   "'zzz']; known keys are [")) as err:
        load_odb_config(path)
    assert str(err.value).endswith("did you mean 'max_tokens' for 'max_tokns', 'window' for 'windw'?")


def test_settings_files_are_found_next_to_the_recipe_and_overrides_in_the_working_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "odb.yaml").write_text("max_tokens: 1234\nwindow: 32\n")
    (tmp_path / "odb.json").write_text(json.dumps({"max_tokens": 777, "window": 16}))
    recipe = tmp_path / "sub" / "r.yaml"
    recipe.write_text("odb_config: odb.yaml\n")
    out = f"output_dir={tmp_path / 'o'}"
    os.chdir(ROOT)  # (the working folder is not the recipe's)
    assert parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe, overrides=[out])).batching.max_tokens == 1234
    os.chdir(tmp_path)
    moved = load_recipe(recipe, overrides=[out, "odb_config=odb.json"])
    assert parse_config([], defaults=DEFAULTS, recipe=moved).batching.max_tokens == 777


def test_a_settings_file_inline_is_the_file(tmp_path):
    """Every settings file given inline (YAML mappings, one an override's {...}) against the same
    files given by path: the same config."""
    files = {"odb_config": {"max_tokens": 512, "window": 32, "gas": 2},
             "data_config": {"train_on": "last", "truncation": "tokens"},
             "deepspeed_config": {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5},
             "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    flags = []
    for key, values in files.items():
        (tmp_path / f"{key}.json").write_text(json.dumps(values))
        flags += [f"--{key}", str(tmp_path / f"{key}.json")]
    out = ["--output_dir", str(tmp_path / "o")]
    recipe = tmp_path / "inline.yaml"
    recipe.write_text("".join(f"{key}: {json.dumps(values)}\n" for key, values in files.items() if key != "lora"))
    inline = load_recipe(recipe, overrides=["lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}"])
    assert parse_config(out, defaults=DEFAULTS, recipe=inline) == parse_config([*flags, *out], defaults=DEFAULTS)
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text("backend: fsdp2\nfsdp_config:\n  reduce_every_micro_batch: true\n  gradient_clipping: 0.0\n")
    (tmp_path / "fsdp.json").write_text(json.dumps({"reduce_every_micro_batch": True, "gradient_clipping": 0.0}))
    assert parse_config(out, defaults=DEFAULTS, recipe=load_recipe(fsdp)) == parse_config(
        ["--backend", "fsdp2", "--fsdp_config", str(tmp_path / "fsdp.json"), *out], defaults=DEFAULTS)


def test_switches_and_optional_values_become_the_flags_they_say(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lora: true\nno_final_checkpoint: true\nstrict: false\ngradient_checkpointing: false\n"
                      "max_steps: null\nmax_tokens: auto\npreflight: on\n")
    config = parse_config(["--output_dir", str(tmp_path / "o")], defaults=DEFAULTS, recipe=load_recipe(recipe))
    assert config.model.lora == json.loads((ROOT / "configs" / "lora.json").read_text())
    assert config.checkpoints.final is False and config.data.processing.strict is False
    assert config.model.gradient_checkpointing is False and config.run.max_steps is None
    assert config.batching.max_tokens == "auto" and config.preflight.preflight == "on"
    recipe.write_text("save_hf: maybe\n")
    with pytest.raises(ValueError, match=re.escape(f"recipe {recipe}: save_hf must be true or false, got 'maybe'")):
        parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe))
    recipe.write_text("epochs: {a: 1}\n")
    with pytest.raises(ValueError, match="epochs takes a value, not a mapping"):
        parse_config([], defaults=DEFAULTS, recipe=load_recipe(recipe))


def test_yaml_reads_numbers_and_words_as_yaml_1_2_does():
    """PyYAML's YAML 1.1 would read 1e-5 as a string and off/yes as booleans (preflight: off -> False)."""
    assert read_yaml("lr: 1e-5\npreflight: off\nx: yes\nd: 2024-01-01\ny: true\nn: .5") == {
        "lr": 1e-5, "preflight": "off", "x": "yes", "d": "2024-01-01", "y": True, "n": 0.5}


def test_overrides_are_key_value_words():
    assert parse_overrides(["a=1", "b=x=y", "c=", "d={stage: 3}", "e=null"]) == {
        "a": "1", "b": "x=y", "c": "", "d": {"stage": 3}, "e": None}
    for bad in ("novalue", "=1", "--lr=1"):
        with pytest.raises(ValueError, match="is not a key=value override"):
            parse_overrides([bad])


def test_a_bundled_recipe_is_found_by_name_and_a_wrong_name_gets_the_nearest():
    assert find_recipe("demo", RECIPES) == RECIPES / "demo.yaml"
    assert find_recipe("qwen2.5-7b-full", RECIPES) == RECIPES / "qwen2.5-7b-full.yaml"
    with pytest.raises(FileNotFoundError, match=re.escape("recipe dmeo does not exist") + ".*did you mean 'demo'"):
        find_recipe("dmeo", RECIPES)


def test_a_printed_recipe_reads_as_the_recipe_from_anywhere(tmp_path):
    """``odb recipes NAME > my.yaml``: its settings files' paths made absolute, the rest as written."""
    for name in OLD_FLAGS:
        copy = tmp_path / f"{name}.yaml"
        copy.write_text(_absolute(RECIPES / f"{name}.yaml", SETTINGS_FILES))
        original = load_recipe(name, folder=RECIPES)
        assert load_recipe(copy).arguments(parse_parser(), settings_files=SETTINGS_FILES) == \
            original.arguments(parse_parser(), settings_files=SETTINGS_FILES)


def parse_parser():
    from odb.training.launch.flags import parser

    return parser(DEFAULTS)


def test_odb_train_starts_the_backend_s_launcher_or_runs_as_a_rank(tmp_path):
    demo = load_recipe("demo", folder=RECIPES)
    words = ["max_samples=100", "output_dir=D"]
    ds = odb_train.launch_command(demo, words, nproc=2, port=29511, backend="deepspeed")
    assert ds[1:] == ["-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29511",
                      "--no_local_rank", "--module", "odb.cli", "train", str(RECIPES / "demo.yaml"), *words]
    torchrun = odb_train.launch_command(demo, words, nproc=4, port=29512, backend="fsdp2")
    assert torchrun[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", "29512", "-m",
                            "odb.cli", "train", str(RECIPES / "demo.yaml"), *words]
    assert not odb_train.under_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})  # a batch script's own shell
    assert odb_train.under_launcher({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8"})
    assert odb_train.under_launcher({"RANK": "1", "LOCAL_RANK": "1"})
    args = odb_train.parser("odb train").parse_intermixed_args(["demo", "--nproc", "2", *words])
    assert (args.recipe, args.nproc, args.overrides) == ("demo", 2, words)
    assert odb_train._nproc(demo, None) == 2 and odb_train._nproc(demo, 3) == 3
    with pytest.raises(ValueError, match="nproc must be an integer >= 1, got '0'"):
        odb_train._nproc(load_recipe("demo", folder=RECIPES, overrides=["nproc=0"]), None)


def test_odb_train_refuses_a_bad_recipe_before_starting_anything(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("nproc: 2\nwindw: 3\n")
    with pytest.raises(SystemExit, match=re.escape(f"odb train: recipe {recipe}: unknown key 'windw'; did you mean "
                                                   "'window'?")):
        odb(["train", str(recipe)])


def test_odb_lists_its_commands_and_names_the_nearest_of_a_wrong_one(capsys):
    assert odb(["--help"]) == 0
    listed = capsys.readouterr().out
    for command in ("train", "export", "show-labels", "check-model", "recipes", "path"):
        assert f"\n  {command} " in listed
    assert odb(["exprt"]) == 2 and "did you mean 'export'?" in capsys.readouterr().err
    assert odb(["path", "slurm.sbatch"]) == 0
    assert capsys.readouterr().out.strip() == str(bundled_root() / "launch" / "slurm.sbatch")
    assert odb(["--local_rank=1", "path", "launch/slurm.sbatch"]) == 0  # (what DeepSpeed's runner may add)
    assert capsys.readouterr().out.strip() == str(bundled_root() / "launch" / "slurm.sbatch")
    assert bundled_root() == ROOT  # (a checkout: its own files; an installed odb: tests/e2e/test_installed.py)
    assert odb(["recipes"]) == 0
    assert sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()) == \
        sorted(p.stem for p in RECIPES.glob("*.yaml"))


def test_the_readme_s_recipe_is_a_valid_recipe(tmp_path):
    block = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[0]
    recipe = tmp_path / "my.yaml"
    recipe.write_text(block)
    config = parse_config([], defaults=DEFAULTS, recipe=load_recipe(
        recipe, overrides=[f"model={TINY}", f"data={CHATS}", f"output_dir={tmp_path / 'o'}"]))
    assert config.optimization.deepspeed["zero_optimization"] == {"stage": 3}
    assert config.batching.max_tokens == "auto" and config.model.gradient_checkpointing
    assert load_recipe(recipe).get("nproc") == 8
