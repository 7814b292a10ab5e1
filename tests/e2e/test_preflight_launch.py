"""The preflight through launch/train.py on 2 CPU ranks: a run with it trains exactly as one
without (losses of every step, exported weights) under DeepSpeed, ZeRO-3 with LoRA (DeepSpeed's
optimizer wrapper and step counters; FSDP2's torch AdamW alone is reset as in
tests/unit/test_preflight.py);
max_tokens auto picks the largest budget measured under --memory_limit_mb, trains with it aligned
and exactly once, and a resumed run keeps that budget (the run's log lines, one per --log_steps,
checked on the way); a budget over the cap stops every rank,
naming the largest that fits; under over_cap 'sequence_parallel' the preflight measures a rank's slice of
the longest sample its largest group holds. (The pieces in one process: tests/unit/test_preflight.py.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import KILLED, TRAIN, _ranks, audit, deepspeed, ds_config, fsdp2, launch_env, odb_config

WORKER = Path(__file__).with_name("preflight_worker.py")
GROUPS_WORKER = Path(__file__).with_name("preflight_groups_worker.py")


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


def weights(out):
    files = sorted((out / "hf").glob("*.safetensors"))
    assert files, f"no export in {out / 'hf'}"
    merged = {}
    for path in files:
        merged.update(load_file(path))
    return merged


@pytest.mark.parametrize("backend", ["zero3-lora"])
def test_a_run_with_the_preflight_trains_exactly_as_one_without(tmp_path, backend):
    common = ["--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16, gas=2)), "--max_samples", "40",
              "--max_steps", "3", "--save_hf", "--no_final_checkpoint"]
    if backend == "fsdp2":
        launch, common = fsdp2, ["--backend", "fsdp2", *common]
    else:
        launch, common = deepspeed, ["--deepspeed_config", str(ds_config(tmp_path, 3)), "--lora", *common]
    launch([*common, "--output_dir", str(tmp_path / "with"), "--preflight", "on"])
    launch([*common, "--output_dir", str(tmp_path / "without"), "--preflight", "off"])
    summary = json.loads((tmp_path / "with" / "summary.json").read_text())
    assert summary["preflight"]["max_tokens"] == 512 and summary["preflight"]["trials"][0]["fits"]
    assert json.loads((tmp_path / "without" / "summary.json").read_text())["preflight"] is None
    assert losses(tmp_path / "with") == losses(tmp_path / "without") and len(losses(tmp_path / "with")) == 3
    with_, without = weights(tmp_path / "with"), weights(tmp_path / "without")
    assert with_.keys() == without.keys()
    assert all(torch.equal(with_[k], without[k]) for k in with_), "the preflight changed the trained weights"


def test_after_the_probe_deepspeed_links_each_parameter_to_the_state_its_first_real_step_made(tmp_path):
    """ZeRO-2 links each parameter to its optimizer state once, at the first step: the probe's step
    must not keep that link (the probe's moments would stay alive, and what DeepSpeed reads of a
    parameter's state would be theirs)."""
    out = tmp_path / "links.json"
    deepspeed([str(out), "2"], nproc=1, script=WORKER)
    links = json.loads(out.read_text())["linked"]
    viewed = [ok for keys in links.values() for ok in keys.values()]
    assert len(viewed) >= 2 * 10 and all(viewed), links


def test_under_over_cap_sequence_parallel_the_preflight_measures_the_largest_group_s_slice(tmp_path):
    """2 ranks, a group of 2, 2048 tokens a rank (tests/e2e/preflight_groups_worker.py): the oracle
    is the sizes alone. The longest sample the group holds is 2 x 2048 tokens, and Ulysses gives
    each rank the whole sample for half the heads, so the largest attention the preflight runs is
    4 / 2 = 2 heads over 4096 tokens: twice the scores of the one-rank sample of 2048 tokens and 4
    heads that it measured without the groups. Prints each rank's peak either way."""
    budget, heads = 2048, 4
    deepspeed([str(tmp_path), str(budget)], nproc=2, timeout=600, script=GROUPS_WORKER)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, cases in result.items():
            grouped, alone = cases["groups"], cases["alone"]
            print(f"rank {rank} {name}: with the group's slice {grouped['heads']} heads x {grouped['length']} tokens, "
                  f"peak {grouped['peak_mb']:.0f} MB, {grouped['step_s']:.2f} s; without it {alone['heads']} heads x "
                  f"{alone['length']} tokens, peak {alone['peak_mb']:.0f} MB, {alone['step_s']:.2f} s")
            assert (grouped["heads"], grouped["length"]) == (heads // 2, 2 * budget), (rank, name, grouped)
            assert (alone["heads"], alone["length"]) == (heads, budget), (rank, name, alone)
            scores = grouped["heads"] * grouped["length"] ** 2
            assert scores == 2 * alone["heads"] * alone["length"] ** 2


def test_max_tokens_auto_trains_with_the_largest_budget_under_the_cap_and_a_resume_keeps_it(tmp_path):
    out = tmp_path / "out"
    common = ["--max_tokens", "auto", "--memory_limit_mb", "150", "--max_samples", "120", "--odb_config",
              str(odb_config(tmp_path, window=16)), "--output_dir", str(out), "--audit_ids"]
    first = deepspeed([*common, "--max_steps", "2", "--save_steps", "1", "--log_steps", "1"])
    # no terminal here, so rank 0 prints a line per --log_steps steps, as on SLURM
    lines = [line for line in first.stdout.splitlines() if line.startswith("odb: step ")]
    assert [line.split(" |")[0] for line in lines] == ["odb: step 1", "odb: step 2"], first.stdout[-3000:]
    assert all(" tok/s | pad " in line and " elapsed, eta " in line for line in lines), lines
    run = json.loads((out / "checkpoints" / "step2" / "run_config.json").read_text())
    chosen = run["batching"]["max_tokens"]
    assert isinstance(chosen, int) and f"max_tokens {chosen} (auto)" in first.stdout
    # to the end of the epoch; a roomier cap, which a new search would fill with a larger budget
    second = deepspeed([*common, "--resume", "--memory_limit_mb", "400"])
    summary = json.loads((out / "summary.json").read_text())
    trials = summary["preflight"]["trials"]
    print("the resumed run's trials:", trials, "the first run's log:",
          [line for line in first.stdout.splitlines() if "preflight" in line])
    assert summary["config"]["batching"]["max_tokens"] == chosen == summary["preflight"]["max_tokens"]
    assert [t["max_tokens"] for t in trials] == [chosen] and trials[0]["fits"]  # checked, not searched again
    assert f"max_tokens auto: {chosen}, as the checkpoint resolved it" in second.stdout
    # the first run's search: the budget it chose fits, the next one up was measured over the cap
    searched = [line for line in first.stdout.splitlines() if line.startswith("odb: preflight: max_tokens ")
                and "(auto)" not in line]
    fits = {int(line.split()[3].rstrip(":")): "(over)" not in line for line in searched}
    assert fits[chosen] and (fits.get(chosen + 64) is False or chosen + 64 > 4096), searched
    assert all(not ok for budget, ok in fits.items() if budget > chosen), searched
    rows = audit(out, 2)
    shapes = [[(r["epoch"], r["step"], r["micro"]) for r in rank] for rank in rows]
    assert shapes[0] == shapes[1], "the ranks ran different steps or micro-batches"
    assert Counter(i for rank in rows for r in rank for i in r["ids"]) == Counter(range(120))


def test_a_budget_over_the_cap_stops_every_rank_naming_the_largest_that_fits(tmp_path):
    done, _ = _ranks(TRAIN, ["--max_tokens", "2048", "--memory_limit_mb", "150", "--max_samples", "40",
                             "--output_dir", str(tmp_path / "out")],
                     2, launch_env(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", LOCAL_SIZE="2"), timeout=300)
    assert done.returncode != 0 and KILLED not in done.stderr, done.stderr[-3000:]
    text = done.stdout + done.stderr
    assert text.count("the worst-case micro-batch at max_tokens 2048 peaks at") >= 2, text[-3000:]  # both ranks
    named = int(text.split("set max_tokens ")[1].split()[0])
    assert 64 <= named < 2048 and named % 64 == 0
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not losses(tmp_path / "out")
