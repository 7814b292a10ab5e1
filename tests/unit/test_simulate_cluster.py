"""tools/sim/simulate_cluster.py on a small trace slice: its plans are odb's own, its report keeps its
keys, and the properties its time model must have hold."""

import json

import numpy as np
import pytest

from conftest import ROOT, tool_module
from odb.batching import align, stream
from odb.batching import decide as decide_module
from odb.batching.config import OdbConfig
from odb.batching.simulate import simulate

TRACE = ROOT.parent / "shared" / "traces" / "sharegpt4o_like.txt"  # has vision patches and long samples
ROW_KEYS = {"trace", "nodes", "gpus", "samples", "fixed_auto_batch", "policies", "speedup"}
POLICY_KEYS = {"steps", "micro_batch_positions", "micro_batches", "dummy_micro_batches", "samples", "padding_ratio",
               "largest_micro_batch_tokens", "seconds", "compute_s", "straggler_s", "comm_s", "optimizer_s",
               "round_s", "samples_per_s", "tokens_per_s"}


def tool():
    return tool_module("simulate_cluster")


@pytest.fixture(scope="module")
def trace_slice(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "slice.txt"
    if TRACE.is_file():
        path.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:600]))
    else:  # a checkout without ../shared: a synthetic long-tailed trace
        path.write_text("".join(f"{int(60 + (i * 7919) % 997 * ((i % 13) + 1) ** 1.3)} {(i * 31) % 5}\n"
                                for i in range(600)))
    return path


ARGS = ["--nodes", "1", "2", "4", "--gpus-per-node", "2", "--samples-per-gpu", "120", "--window", "48",
        "--max-tokens", "8192", "--fixed-batch", "8", "--json"]


@pytest.fixture(scope="module")
def report(trace_slice):
    return tool().main(["--trace", str(trace_slice), *ARGS])


def test_prints_one_json_object_with_the_documented_keys(trace_slice, capsys):
    printed = tool().main(["--trace", str(trace_slice), *ARGS[:-1], "--nodes", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(printed))
    assert out[0].startswith("| trace | nodes x GPUs | odb samples/s")
    assert set(printed) == {"settings", "results", "wall_s"}
    assert set(printed["settings"]) == {"model", "cluster", "odb", "samples_per_gpu", "fixed_batch"}
    row = printed["results"][0]
    assert set(row) == ROW_KEYS
    assert set(row["policies"]) == {"odb", "gmt", f"fixed_b{row['fixed_auto_batch']}", "fixed_b8"}
    assert all(set(p) == POLICY_KEYS for p in row["policies"].values())
    assert set(row["speedup"]) == {f"odb/{k}" for k in row["policies"] if k != "odb"}


def test_micro_batch_counts_equal_odb_simulate(report, trace_slice):
    """The tool plans with odb itself: a direct simulate() of the same samples and config agrees."""
    sim = tool()
    trace = sim.read_trace(trace_slice)
    base = report["settings"]["odb"]
    configs = sim.policy_configs(OdbConfig(**base), [sim.fixed_batch_for(trace, base["max_tokens"]), 8])
    for row in report["results"]:
        lengths = sim.workload(trace, row["samples"], base["seed"])
        for key in ("odb", "gmt", f"fixed_b{row['fixed_auto_batch']}"):
            result = simulate(configs[key], lengths, row["gpus"])
            micro = [m for steps in result.steps for step in steps for m in step.micro_batches]
            got = row["policies"][key]
            assert got["micro_batches"] == sum(not m.is_dummy for m in micro), (key, row["nodes"])
            assert got["dummy_micro_batches"] == sum(m.is_dummy for m in micro)
            assert got["steps"] == len(result.steps[0])
            assert got["samples"] == row["samples"]  # join mode: every sample exactly once


def test_streamed_plan_with_shared_decisions_equals_simulate(trace_slice):
    """plan() reduces each step as it comes, shares one decision per round among the simulated
    ranks and shrinks gmt's round vector: the per-rank figures of every micro-batch are still
    those of odb.batching.simulate."""
    sim = tool()
    lengths = sim.workload(sim.read_trace(trace_slice), 8 * 90, 3)
    base = OdbConfig(max_tokens=4096, window=32, gas=2, seed=3)
    for key, config in sim.policy_configs(base, [1, 8]).items():
        streamed = sim.plan(config, lengths, 8)
        direct = sim.plan_arrays(simulate(config, lengths, 8))
        for name in ("tokens", "area", "patches", "gas"):
            assert np.array_equal(streamed[name], direct[name]), (key, name)
        assert all(streamed[k] == direct[k] for k in ("real", "materialized", "samples", "dummies")), key
        assert streamed["samples"] == len(lengths)
    assert align.decide is decide_module.decide and stream.epoch_order.__module__ == "odb.batching.stream"  # restored


def test_speedups_are_positive_and_are_the_samples_per_s_ratios(report):
    for row in report["results"]:
        odb = row["policies"]["odb"]["samples_per_s"]
        for key, value in row["speedup"].items():
            assert value > 0
            assert value == pytest.approx(odb / row["policies"][key.split("/")[1]]["samples_per_s"], rel=1e-3)
        for p in row["policies"].values():
            assert p["straggler_s"] >= 0 and p["compute_s"] > 0
            assert p["seconds"] == pytest.approx(p["compute_s"] + p["straggler_s"] + p["comm_s"] + p["optimizer_s"]
                                                 + p["round_s"], abs=1e-3)
            assert p["round_s"] > 0
        assert row["policies"]["odb"]["padding_ratio"] == 0
        assert row["policies"]["odb"]["largest_micro_batch_tokens"] <= 8192


def test_the_round_term_counts_every_round_of_the_plan_at_its_latency_and_bytes(trace_slice):
    """The plan's rounds are odb's own (simulate() counts them); at zero latency and infinite
    bandwidth the term is the measured decisions alone, and each microsecond of latency adds
    2 ceil(log2 W) per round."""
    sim = tool()
    lengths, world = sim.read_trace(trace_slice), 16
    config = OdbConfig(max_tokens=8192, window=64)
    arrays = sim.plan(config, lengths, world)
    rounds = simulate(config, lengths, world).batchers[0].round_index
    assert len(arrays["round_decision_s"]) == len(arrays["round_received"]) == rounds
    free = sim.Cluster(nodes=2, round_alpha_us=0.0, round_beta_gbs=1e30).round_s(
        arrays["round_decision_s"], arrays["round_received"])
    assert free == pytest.approx(arrays["round_decision_s"].sum())
    slow = sim.Cluster(nodes=2, round_alpha_us=10.0, round_beta_gbs=1e30).round_s(
        arrays["round_decision_s"], arrays["round_received"])
    assert slow - free == pytest.approx(rounds * 2 * 4 * 10e-6)
    # every rank's row: at least the proposal's scalars each, from every one of the 16 ranks
    assert (arrays["round_received"] >= 8 * 16 * 13).all()


def test_one_gpu_has_no_communication(trace_slice):
    one = tool().main(["--trace", str(trace_slice), *ARGS[:-1], "--nodes", "1", "--gpus-per-node", "1"])
    assert all(p["comm_s"] == 0 for p in one["results"][0]["policies"].values())


def test_more_nodes_never_predict_fewer_samples_per_s_at_a_fixed_per_gpu_load(trace_slice):
    """With one bandwidth inside and between nodes (the step from NVLink to the network alone can
    make 2 nodes slower than 1 for tiny micro-batches), each GPU brings the same load: the
    aggregate rate grows with the nodes, for every policy."""
    report = tool().main(["--trace", str(trace_slice), *ARGS, "--inter-gbs", "450"])
    rows = report["results"]
    for key in rows[0]["policies"]:
        rates = [row["policies"][key]["samples_per_s"] for row in rows]
        assert rates == sorted(rates), (key, rates)


def test_ring_collectives_follow_the_stated_formulas():
    sim = tool()
    model = sim.LLAMA2_7B
    assert model.params == 6_738_149_376 and model.layers == 32 and model.hidden == 4096
    one_node = sim.Cluster(nodes=1, gpus_per_node=8)
    two_nodes = sim.Cluster(nodes=2, gpus_per_node=8)
    size = 2 * model.params
    assert one_node.comm_s(model) == pytest.approx((2 * 7 / 8 * size / 450e9, 7 / 8 * size / 450e9))
    assert two_nodes.comm_s(model) == pytest.approx((2 * 15 / 16 * size / 50e9, 15 / 16 * size / 50e9))
    zero3 = sim.Cluster(nodes=2, gpus_per_node=8, zero=3)
    assert zero3.comm_s(model) == pytest.approx((3 * 15 / 16 * size / 50e9, 0.0))
    assert sim.Cluster(nodes=1, gpus_per_node=1).comm_s(model) == (0.0, 0.0)


def test_cpu_fit_recovers_non_negative_coefficients():
    rng = np.random.default_rng(0)
    features = np.column_stack([rng.uniform(1e9, 5e9, 50), rng.uniform(1e7, 9e8, 50), np.ones(50)])
    truth = np.array([1 / 2e10, 1 / 4e9, 0.03])
    fitted = tool()._nnls(features, features @ truth)
    assert fitted == pytest.approx(truth, rel=1e-6)
    assert np.all(tool()._nnls(features, -features @ truth) >= 0)
