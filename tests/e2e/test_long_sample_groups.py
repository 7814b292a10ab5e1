"""over_cap 'sequence_parallel': long samples trained whole by groups of ranks, per micro-batch.

One step on 2 and 4 CPU ranks under ZeRO-3 (tests/e2e/long_sample_worker.py): at some positions a
group of ranks trains a long sample together (its owner sends it; each rank attends over the whole
sample through DeepSpeed's Ulysses all-to-all on its slice), while the other ranks train their own
packed rows or a dummy. The oracle is one plain process, the model's own eager attention and loss
on each sample alone: the token loss summed over the ranks, in all and per source, agrees to 1e-6,
and the step's gradient to 1e-5 relative to each parameter's largest entry (Qwen3-MoE: the token
loss, and finite gradients; its router loss is each slice's). Then a whole run of launch/train.py
on 4 ranks whose data holds samples up to 4x a rank's budget: every record trains exactly once,
whole up to 4x the budget, the ranks stay aligned.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from launch import ROOT, audit, deepspeed, ds_config, odb_config

WORKER = Path(__file__).resolve().parent / "long_sample_worker.py"


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 4])
def test_long_samples_on_groups_beside_other_ranks_work_equal_one_process_on_each_sample_alone(tmp_path, world):
    deepspeed([str(tmp_path)], nproc=world, timeout=600, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for name, result in ranks[0].items():
        oracle = result["oracle"]
        for mode in ("full", "chunked"):
            total = sum(values[name]["losses"][mode] for values in ranks)
            per_source = {s: sum(values[name]["sources"][mode].get(s, 0.0) for values in ranks) for s in oracle}
            print(f"{name} {mode}: token loss over the ranks {total:.6f}, own {sum(oracle.values()):.6f}; "
                  f"per source {per_source} against {oracle}; gradient {result['grads'][mode]['rel']:.1e}")
            assert abs(total - sum(oracle.values())) <= 1e-6 * sum(oracle.values()), (name, mode)
            for source, own in oracle.items():
                assert abs(per_source[source] - own) <= 1e-6 * own, (name, mode, source)
            if name == "qwen3_moe":
                assert all(math.isfinite(values[name]["losses"][f"{mode} router"]) for values in ranks)
            else:
                assert result["grads"][mode]["rel"] <= 1e-5, (name, mode, result["grads"][mode])
        assert all(values[name]["finite"] for values in ranks), name
    for r in range(world):  # a plan that disagrees with the data stops every rank of the group
        error = (tmp_path / f"mismatch{r}.txt").read_text()
        assert "rank 0 holds a long sample of 96 tokens" in error and "where the plan says 97" in error, (r, error)


def test_a_run_on_four_ranks_trains_long_samples_whole_on_groups_and_resumes_on_two(tmp_path):
    """launch/train.py (ZeRO-2, the tiny model, the bundled data's first 120 records) at 64 tokens a
    rank with over_cap sequence_parallel: on 4 ranks samples up to 4 x 64 train whole on groups of 2
    or 4 ranks; stopped after 2 steps and resumed on 2 ranks, where groups of 2 hold up to 128 (the
    samples it holds are processed again and planned as cut now). The oracle is the data's own token
    lengths: every record trains exactly once over the two runs, the ranks stay aligned, and in the
    first run exactly the records over 256 tokens are cut."""
    from odb.data.processing import DataConfig, SampleDataset, sample_sizes
    from odb.training.model.build import load_tokenizer

    dataset = SampleDataset(str(ROOT / "data" / "chat.jsonl"), load_tokenizer(str(ROOT / "data" / "tokenizer")),
                            DataConfig(), seed=0, max_samples=120)
    lengths = [sample_sizes(dataset[i])[0] for i in range(len(dataset))]
    out = tmp_path / "run"
    config = odb_config(tmp_path, max_tokens=64, window=8, lookahead=4, gas=2, over_cap="sequence_parallel")
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--data", str(ROOT / "data" / "chat.jsonl"),
              "--max_samples", "120", "--output_dir", str(out), "--audit_ids", "--num_workers", "1",
              "--odb_config", str(config)]
    first = deepspeed([*common, "--max_steps", "2", "--save_steps", "2", "--no_final_checkpoint"], nproc=4,
                      timeout=600)
    assert "trains whole on a group of 2 or 4 consecutive ranks (up to 4 x 64 = 256 tokens" in first.stdout
    before = audit(out, 4)
    assert len({tuple((r["step"], r["micro"]) for r in rank) for rank in before}) == 1  # aligned
    for r in range(4):
        (out / f"emitted_ids.rank{r}.jsonl").rename(out / f"first.rank{r}.jsonl")
    resumed = deepspeed([*common, "--resume"], nproc=2, timeout=600)
    assert "trains whole on a group of 2 consecutive ranks (up to 2 x 64 = 128 tokens" in resumed.stdout
    assert "saved by 4 ranks" in resumed.stdout
    after = audit(out, 2)
    assert len({tuple((r["step"], r["micro"]) for r in rank) for rank in after}) == 1
    trained = Counter(i for rank in before + after for row in rank for i in row["ids"])
    summary = json.loads((out / "summary.json").read_text())
    # (cut to the 2-rank groups' 128 tokens, a record whose first label lies beyond them is skipped, counted)
    missing = sorted(set(range(120)) - set(trained))
    assert trained == Counter(set(range(120)) - set(missing)) and sum(summary["skipped"].values()) == len(missing)
    assert all(lengths[i] > 128 for i in missing)
    whole = [n for n in lengths if 64 < n <= 256]
    assert len(whole) > 10 and any(n > 128 for n in whole) and summary["long_samples"] > 0
    assert summary["truncated_samples"] >= sum(n > 256 for n in lengths)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in metrics if "loss" in r)
    print(f"{len(before[0])} + {len(after[0])} audit rows per rank; {summary['long_samples']} samples over a "
          f"rank's 64 tokens trained whole on groups, {summary['truncated_samples']} cut, {len(missing)} skipped "
          "(cut to no label on 2 ranks)")
