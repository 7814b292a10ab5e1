"""Sequence parallelism (odb/training/step/sequence_parallel.py) on CPU ranks over gloo.

One step on 2 and 4 ranks under ZeRO-3 (tests/e2e/sequence_parallel_worker.py): each group of S
ranks trains its micro-batches together, each rank on its slice of every packed row (packed rows
of several samples, a sample longer than a rank's budget, a dummy), through DeepSpeed's Ulysses
all-to-all around odb's attention. The oracle is one plain process, the model's own eager
attention and loss on each sample alone: the step's gradient (full-logits and chunked loss) must
agree with it to 1e-5 relative to each parameter's largest entry, and the loss each group
reports, in all and per source, to 1e-6. Then whole runs of launch/train.py: stopped and resumed
on other groups (the data's own lengths as the oracle), under FSDP2 and with a mixture-of-experts
model (one process without sequence parallelism as the oracle).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path

import pytest

from launch import ROOT, audit, deepspeed, ds_config, fsdp2, odb_config

WORKER = Path(__file__).resolve().parent / "sequence_parallel_worker.py"


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_loss_and_gradients_equal_one_process_on_each_sample_alone(tmp_path, world):
    start = time.monotonic()
    deepspeed([str(tmp_path)], nproc=world, timeout=600, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    print(f"launch took {time.monotonic() - start:.0f} s")
    sizes = (2,) if world == 2 else (2, 4)
    assert set(ranks[0]) == {f"S{s} {m}" for s in sizes for m in ("qwen2_lora", "gemma2", "qwen3_moe", "gpt_oss")
                             } | {f"S{sizes[-1]} gemma2 checkpointed"}
    for name in [f"S{s} {m}" for s in sizes for m in ("qwen3_moe", "gpt_oss")]:
        for rank, values in enumerate(ranks):
            moe = values.pop(name)
            evaluated, short = moe["eval"], moe["short_rows"]
            print(f"{name} rank {rank}: evaluated group loss {evaluated['loss']:.6f}, own {evaluated['oracle']:.6f}; "
                  f"rows of 3 and 5 tokens: loss {short['loss']:.4f}, router {short['aux']:.4f}, "
                  f"gradients finite {short['finite']}")
            assert abs(evaluated["loss"] - evaluated["oracle"]) <= 1e-6 * evaluated["oracle"], (name, rank)
            assert short["finite"] and math.isfinite(short["loss"]) and math.isfinite(short["aux"]), (name, rank)
    for name, result in ranks[0].items():
        for rank, values in enumerate(ranks):
            losses, sources = values[name]["losses"], values[name]["sources"]
            print(f"{name} rank {rank}: group loss full {losses['full']:.6f}, chunked {losses['chunked']:.6f}, "
                  f"own {losses['oracle']:.6f}; per source {sources}")
            assert losses["oracle"] > 0
            for mode in ("full", "chunked"):
                assert abs(losses[mode] - losses["oracle"]) <= 1e-6 * losses["oracle"], (name, rank, mode)
                assert sources[mode].keys() == sources["oracle"].keys(), (name, rank, sources)
                for source, own in sources["oracle"].items():
                    assert abs(sources[mode][source] - own) <= 1e-6 * own, (name, rank, mode, source)
        for mode, worst in result["grads"].items():
            print(f"{name} {mode}: worst relative gradient difference from the own loss's {worst['rel']:.1e} "
                  f"(abs {worst['abs']:.1e}, {worst['worst']}), norm {result['grad_norm']:.3e}")
            assert worst["rel"] <= 1e-5, (name, mode, worst)
        assert result["grad_norm"] > 0


def test_a_run_on_groups_of_four_then_of_two_trains_every_sample_once_and_whole_up_to_the_group_budget(tmp_path):
    """launch/train.py (ZeRO-2, the tiny model, the bundled data's first 120 records): 4 ranks as one
    group of 4 at 64 tokens a rank (a micro-batch of up to 256: samples 4x a rank's budget train
    whole), stopped after 2 steps; resumed as 2 groups of 2 at 128 a rank (the same 256), with
    activation checkpointing (each layer's all-to-all runs again in the backward). The
    oracle is the data's own token lengths: every record trains exactly once over the two runs,
    the groups stay aligned, and exactly the records over 256 tokens are cut."""
    from odb.data.processing import DataConfig, SampleDataset, sample_sizes
    from odb.training.model.build import load_tokenizer

    dataset = SampleDataset(str(ROOT / "data" / "chat.jsonl"), load_tokenizer(str(ROOT / "data" / "tokenizer")),
                            DataConfig(), seed=0, max_samples=120)
    lengths = [sample_sizes(dataset[i])[0] for i in range(len(dataset))]
    out = tmp_path / "run"
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--data", str(ROOT / "data" / "chat.jsonl"),
              "--max_samples", "120", "--output_dir", str(out), "--audit_ids", "--num_workers", "1"]

    def args(size: int, rank_tokens: int) -> list[str]:
        config = odb_config(tmp_path, max_tokens=rank_tokens, window=8, lookahead=4, gas=2)
        return [*common, "--odb_config", str(config), "--sequence_parallel_size", str(size)]

    first = deepspeed([*args(4, 64), "--max_steps", "2", "--save_steps", "2", "--no_final_checkpoint"], nproc=4,
                      timeout=600)
    assert "1 group(s) of 4 ranks; a micro-batch holds up to 4 x 64 = 256 tokens" in first.stdout
    before = audit(out, 1)
    (out / "emitted_ids.rank0.jsonl").rename(out / "first.rank0.jsonl")
    resumed = deepspeed([*args(2, 128), "--resume", "--gradient_checkpointing"], nproc=4, timeout=600)
    assert "2 group(s) of 2 ranks; a micro-batch holds up to 2 x 128 = 256 tokens" in resumed.stdout
    assert "saved by 1 data-parallel ranks, its untrained samples dealt to 2" in resumed.stdout
    after = audit(out, 2)
    assert len({tuple((r["step"], r["micro"]) for r in rank) for rank in after}) == 1  # the groups aligned
    trained = Counter(i for rank in before + after for row in rank for i in row["ids"])
    assert trained == Counter(range(120))
    whole = [n for n in lengths if 64 < n <= 256]
    assert any(n > 192 for n in whole), "no sample 3-4x a rank's budget among the 120"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["truncated_samples"] == sum(n > 256 for n in lengths) > 0
    assert summary["world_size"] == 4 and summary["sequence_parallel_size"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    print(f"{len(before[0])} + {len(after[0])} audit rows; {len(whole)} of 120 samples over a rank's 64 tokens "
          f"trained whole in groups, {summary['truncated_samples']} over 256 cut")


def test_fsdp2_groups_of_two_train_and_evaluate_as_one_process_does(tmp_path):
    """launch/train.py under FSDP2 (fp32, AdamW at the demo's learning rate, 60 records, a fifth held
    out and evaluated every 4 steps): 2 ranks as one group of 2 at 128 tokens a rank against one
    process at 256, the same plans. The oracle is the one process, without sequence parallelism:
    every step's loss (after the steps before it changed the weights) and every validation loss
    (validation samples over 256 tokens scored whole) agree to 1e-5."""
    common = ["--backend", "fsdp2", "--data", str(ROOT / "data" / "chat.jsonl"), "--max_samples", "60",
              "--val_ratio", "0.2", "--eval_steps", "4", "--log_steps", "1", "--num_workers", "1"]
    runs = {}
    for name, size, tokens in (("groups", 2, 128), ("one", 1, 256)):
        config = odb_config(tmp_path, max_tokens=tokens, window=8, lookahead=4, gas=2)
        fsdp2([*common, "--odb_config", str(config), "--sequence_parallel_size", str(size),
               "--output_dir", str(tmp_path / name)], nproc=2 if size == 2 else 1)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([(r["samples"], r["loss"]) for r in rows if "loss" in r],
                      [(r["eval_samples"], r["eval_over_cap"], r["eval_loss"]) for r in rows if "eval_loss" in r])
    (steps, evals), (own_steps, own_evals) = runs["groups"], runs["one"]
    print("per-step loss, groups of 2 / one process:", [(round(a[1], 6), round(b[1], 6))
                                                       for a, b in zip(steps, own_steps)])
    print("validation (samples, over the cap, loss), groups of 2 / one process:", evals, own_evals)
    assert len(steps) == len(own_steps) >= 8 and len(evals) == len(own_evals) >= 2
    for (samples, loss), (own_samples, own) in zip(steps, own_steps, strict=True):
        assert samples == own_samples and abs(loss - own) <= 1e-5 * own
    for (samples, over, loss), (own_samples, own_over, own) in zip(evals, own_evals, strict=True):
        assert (samples, over) == (own_samples, own_over) and abs(loss - own) <= 1e-5 * own
    assert own_evals[0][1] > 0, "no validation sample over the cap: the whole-sample path went untested"


def test_a_mixture_of_experts_model_trains_in_groups_with_its_router_loss(tmp_path):
    """launch/train.py (ZeRO-2, a tiny random Qwen3-MoE, 32 records): 2 ranks as a group of 2 at 128
    tokens a rank against one process at 256, the same plans. The oracle is the one process: the
    first step's loss (before any update) agrees to 1e-5; the router loss is each slice's (the
    training guide says so), so later steps differ a little, and every step logs a finite one."""
    from test_moe_ranks import QWEN3_MOE

    from launch import write_json

    model = write_json(tmp_path / "qwen3_moe.json", QWEN3_MOE)
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--model", str(model), "--data",
              str(ROOT / "data" / "chat.jsonl"), "--max_samples", "32", "--log_steps", "1", "--num_workers", "1"]
    runs = {}
    for name, size, tokens in (("groups", 2, 128), ("one", 1, 256)):
        config = odb_config(tmp_path, max_tokens=tokens, window=8, lookahead=4, gas=2)
        deepspeed([*common, "--odb_config", str(config), "--sequence_parallel_size", str(size),
                   "--output_dir", str(tmp_path / name)], nproc=size)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [r for r in rows if "loss" in r]
    groups, one = runs["groups"], runs["one"]
    print("per step (loss, aux_loss), groups of 2 / one process:",
          [((round(a["loss"], 5), round(a["aux_loss"], 5)), (round(b["loss"], 5), round(b["aux_loss"], 5)))
           for a, b in zip(groups, one)])
    assert [r["samples"] for r in groups] == [r["samples"] for r in one] and len(one) >= 4
    assert abs(groups[0]["loss"] - one[0]["loss"]) <= 1e-5 * one[0]["loss"]
    assert all(math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in groups)
