"""tools/bench/bench_preference.py on a small trace: its padded baselines' figures against a
brute-force count of the rows they materialize, and every system trains every pair once."""

import json

import pytest

from tools.bench import bench_preference as bench

ARGS = ["--pairs", "300", "--max_tokens", "8192", "--max_prompt", "512", "--max_answer", "512", "--seed", "3"]


def brute_force(pairs, ranks):
    """Real and padding tokens of padded micro-batches, from the rows themselves: each pair's two
    sequences as rows of 1s, every row filled with 0s to the micro-batch's longest."""
    real = pad = 0
    for rank in ranks:
        for micro in rank:
            rows = [[1] * n for i in micro.pairs for n in (pairs[i].prompt + pairs[i].chosen,
                                                           pairs[i].prompt + pairs[i].rejected)]
            width = max(map(len, rows))
            rows = [row + [0] * (width - len(row)) for row in rows]
            real += sum(cell for row in rows for cell in row)
            pad += sum(1 - cell for row in rows for cell in row)
    return real, pad


def test_the_tool_runs_and_prints_its_tables_and_one_json_object(capsys):
    result = bench.main([*ARGS, "--world_sizes", "2", "--json"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == result
    rows = result["world_sizes"]["2"]
    assert set(rows) == set(bench.SYSTEMS) and rows["odb"]["padding_ratio"] == 0.0
    assert all(r["pairs"] == 300 and r["compute_vs_odb"] >= 1.0 for r in rows.values())


@pytest.mark.parametrize("world", [2, 8])
def test_the_padded_figures_equal_a_brute_force_count_of_the_padded_rows(world):
    args = bench.parse_args([*ARGS, "--world_sizes", str(world)])
    pairs = bench.preference_trace(args.pairs, args.seed, max_prompt=512, max_answer=512)
    longest = max(p.prompt + max(p.chosen, p.rejected) for p in pairs)
    size = bench.padded_batch_size(pairs, args.max_tokens)
    assert 2 * size * longest <= args.max_tokens < 2 * (size + 1) * longest and size > 1  # the budget-safe B
    report = bench.run(args)["world_sizes"][str(world)]
    for name, ranks in (("padded", bench.padded_batches(pairs, world, args.max_tokens, args.seed)),
                        ("grouped", bench.grouped_batches(pairs, world, args.max_tokens, args.seed, args.bucket_size))):
        real, pad = brute_force(pairs, ranks)
        assert real == report[name]["real_tokens"] == sum(p.tokens for p in pairs)
        assert report[name]["materialized_tokens"] == real + pad
        assert report[name]["padding_ratio"] == round(pad / (real + pad), 4)
        assert report[name]["materialized_per_pair"] == round((real + pad) / len(pairs), 1)
        assert report[name]["micro_batches"] == sum(map(len, ranks))
        assert all(2 * len(m.pairs) * max(pairs[i].longest for i in m.pairs) <= args.max_tokens
                   for rank in ranks for m in rank)
    fixed = bench.padded_batches(pairs, world, args.max_tokens, args.seed)
    assert all(len(m.pairs) == size for rank in fixed for m in rank[:-1])


def test_one_pair_a_micro_batch_pads_each_pairs_shorter_sequence_to_its_longer():
    pairs = bench.preference_trace(200, seed=5)
    max_tokens = 2 * max(p.longest for p in pairs)  # B = 1
    report = bench.metrics(pairs, bench.padded_batches(pairs, 2, max_tokens, seed=5))
    pad = sum(abs(p.chosen - p.rejected) for p in pairs)
    assert report["materialized_tokens"] - report["real_tokens"] == pad
