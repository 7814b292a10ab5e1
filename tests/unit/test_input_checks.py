"""A typo fails before the heavy imports: ``launch/train.py`` and ``odb train`` check every input
that needs no torch (values, paths, the backend's file, the output folder) first, so each such
error comes in a second with the fix, not after torch, transformers and DeepSpeed load.

Each case runs in a fresh interpreter with torch blocked (``sys.modules["torch"] = None``: any
``import torch`` raises): the error it prints must be the input's, not torch's."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = """
import runpy, sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__") if script.endswith(".py") else runpy.run_module(script, run_name="__main__")
"""


def blocked(*argv: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT), "PYTHONPATH": str(ROOT)}  # no launcher's RANK
    return subprocess.run([sys.executable, "-c", BLOCKED, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env=env)


@pytest.mark.parametrize("args,needle", [
    (["--data", "nope.jsonl"], "--data path nope.jsonl does not exist; pass --data data/chat.jsonl"),
    (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["--deepspeed_config", "nope.json"], "DeepSpeed config nope.json does not exist; pass --deepspeed_config "
                                          "configs/ds_zero2.json"),
    (["--backend", "fsdp2", "--fsdp_config", "nope.json"],
     "FSDP2 config nope.json does not exist; pass --fsdp_config configs/fsdp2.json"),
    (["--backend", "fsdp2", "--deepspeed_config", "configs/ds_zero2.json"], "pass --backend deepspeed, or drop"),
    (["--model", "nope"], "model nope does not exist; pass a local HF model folder"),
    (["--max_tokens", "0"], "--max_tokens must be >= 1, got 0"),
    (["--warmup_ratio", "2"], "--warmup_ratio"),
    (["--save_adapter_only"], "--save_adapter_only saves a LoRA adapter"),
], ids=["data", "lr", "deepspeed_config", "fsdp_config", "two_backends", "model", "max_tokens", "warmup",
        "adapter_without_lora"])
def test_a_bad_input_is_named_without_importing_torch(args, needle):
    proc = blocked("launch/train.py", *args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_good_inputs_pass_the_checks_and_reach_torch():
    """The bundled defaults pass every light check: the first thing that fails is torch's import."""
    proc = blocked("launch/train.py", "--output_dir", "runs/never-written")
    assert proc.returncode == 1 and "import of torch halted" in proc.stderr, proc.stderr[-2000:]
    assert not (ROOT / "runs" / "never-written").exists()


@pytest.mark.parametrize("override,needle", [("lr=-1", "--lr must be >= 0"),
                                              ("data=nope.jsonl", "--data path nope.jsonl does not exist")])
def test_odb_train_checks_the_inputs_before_it_starts_the_launcher(override, needle):
    proc = blocked("odb.cli", "train", "demo", "--nproc", "2", override)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert needle in proc.stderr and "launch" not in proc.stdout, (proc.stdout + proc.stderr)[-2000:]


def test_a_bad_input_with_overwrite_output_dir_leaves_the_earlier_run_in_place(tmp_path):
    """--overwrite_output_dir removes an earlier run only once every input is known good: a model
    config of an unknown type fails with the earlier run's files still there (a review's finding)."""
    from odb.training.launch.flags import FileDefaults, parse_config

    out = tmp_path / "out"
    (out / "checkpoints" / "step1").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "lamma"}')
    with pytest.raises(ValueError, match='"model_type" must name a transformers model type'):
        parse_config(["--model", str(bad), "--output_dir", str(out), "--overwrite_output_dir"],
                     defaults=FileDefaults.bundled(ROOT))
    assert (out / "summary.json").is_file() and (out / "checkpoints" / "step1").is_dir()
