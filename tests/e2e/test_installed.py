"""An installed odb, not a clone: the package built from a copy of the checkout's sources and
installed (``pip install``, not editable; no network: no dependencies, this environment's setuptools)
into a folder of its own, then its ``odb`` command run from a folder outside the checkout, as
docs/recipes.md says a user runs it: ``odb train demo --nproc 2 max_samples=100 output_dir=D``.
The run must find everything in the installed package (the bundled recipe, tiny model config,
tokenizer and chat data), train every one of the 100 samples exactly once, and keep the ranks
aligned (the ranks' audit of what each micro-batch held)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter

from conftest import ROOT
from launch import audit, build_cpu_ops, free_port, launch_env, shm_leftovers

SOURCES = ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "odb", "configs", "launch", "data/chat.jsonl",
           "data/tokenizer", "data/vl_tokenizer")
"""What ``pip install .`` reads of a clone (the rest of the checkout is not needed, and a copy keeps
the build's own folders out of the checkout)."""


def install(tmp_path):
    """The package installed into ``tmp_path / "site"``; its folder."""
    source, site = tmp_path / "src", tmp_path / "site"
    for name in SOURCES:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "_bundled"))
        else:
            shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return site


def test_an_installed_odb_trains_the_demo_recipe_from_outside_the_checkout(tmp_path):
    site = install(tmp_path)
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "elsewhere" / "run"
    elsewhere.mkdir()
    env = launch_env(PYTHONPATH=str(site), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    build_cpu_ops(env)
    odb = str(site / "bin" / "odb")
    where = subprocess.run([odb, "path"], capture_output=True, text=True, env=env, cwd=elsewhere, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    bundle = site / "odb" / "_bundled"
    assert where.stdout.strip() == str(bundle)  # (not the checkout's files)
    assert (bundle / "launch" / "slurm.sbatch").is_file() and (bundle / "data" / "tokenizer").is_dir()
    port = free_port()
    try:
        run = subprocess.run([odb, "train", "demo", "--nproc", "2", "max_samples=100", f"output_dir={out}",
                              "audit_ids=true", "--master_port", str(port)],
                             capture_output=True, text=True, env=env, cwd=elsewhere, timeout=300)
    finally:
        left = shm_leftovers(port)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    assert not left, f"the run left DeepSpeed's shared memory behind: {left}"
    assert f"odb train: 2 ranks of {bundle / 'configs' / 'recipes' / 'demo.yaml'}" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples_emitted"] == 100 and summary["dataset_samples"] == 100
    config = summary["config"]
    assert config["model"]["path"] == str(bundle / "configs" / "tiny_model.json")
    assert config["data"]["path"] == str(bundle / "data" / "chat.jsonl")
    assert config["optimization"]["deepspeed"]["zero_optimization"]["stage"] == 2
    rows = audit(out, 2)
    shapes = [[(r["epoch"], r["step"], r["micro"]) for r in rank] for rank in rows]
    assert shapes[0] == shapes[1], "the ranks ran different steps or micro-batches"
    assert Counter(i for rank in rows for r in rank for i in r["ids"]) == Counter(range(100))
