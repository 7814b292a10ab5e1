"""tools/sim/simulate_long_context.py: its trace, its all-to-all term and its plans, each against a
hand computation (the model of time itself is a model: docs/benchmarks.md says so)."""

import numpy as np

from conftest import tool_module
from odb.batching.config import OdbConfig


def tool():
    return tool_module("simulate_long_context")


def test_the_trace_holds_the_long_share_at_4_to_16_times_the_budget_and_the_rest_within_it():
    lengths = np.array(tool().long_tail(2000, 1000, long_share=0.05, seed=1))
    long = lengths[lengths > 1000]
    assert len(lengths) == 2000 and len(long) == 100
    assert long.min() >= 4000 and long.max() <= 16000 and lengths.min() >= 16
    assert lengths.tolist() == tool().long_tail(2000, 1000, long_share=0.05, seed=1)  # seeded


def test_the_all_to_all_term_is_four_exchanges_of_the_slice_per_layer_and_pass():
    simulate_cluster = tool_module("simulate_cluster")
    model = simulate_cluster.Model("m", layers=2, hidden=8, ffn=16, vocab=10, kv_hidden=4, tied=True)
    cluster = simulate_cluster.Cluster(intra_gbs=1e-9)  # 1 byte/s: the term is the bytes each GPU sends
    tokens = np.array([[400.0]])
    # per layer and pass: q and the output (hidden wide), k and v (kv_hidden), bf16, a 1/4 slice, 3/4 of it sent
    by_hand = 2 * 2 * (8 + 8 + 4 + 4) * 2 * (400 / 4) * (3 / 4)
    assert float(tool().all_to_all_seconds(tokens, model, cluster, 4)[0, 0]) == by_hand
    assert float(tool().all_to_all_seconds(tokens, model, cluster, 1)[0, 0]) == 0


def test_each_system_trains_every_sample_once_cut_to_its_groups_budget():
    simulate_cluster = tool_module("simulate_cluster")
    model = simulate_cluster.load_model("7b")
    cluster = simulate_cluster.Cluster(nodes=1, gpus_per_node=8)
    base = OdbConfig(max_tokens=1000, window=32, cost_model="manual", seed=0)
    lengths = tool().long_tail(400, 1000, long_share=0.05, seed=2)
    for size in (1, 2, 4, 8):
        result = tool().simulate_system(size, lengths, base, model, cluster)
        cut = sum(max(0, n - size * 1000) for n in lengths)
        assert result["cut_share"] == round(cut / sum(lengths), 4)
        assert result["samples_cut"] == sum(n > size * 1000 for n in lengths)
        assert 0 < result["sync_efficiency"] <= 1 and result["samples_per_s"] > 0
    plan = simulate_cluster.plan(base, [(min(n, 2000), 0) for n in lengths], 4)  # sp2 on 8 GPUs: 4 groups
    assert plan["samples"] == 400 and plan["tokens"].max() <= 2000
