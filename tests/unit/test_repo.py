"""The repository's promises: CI runs the README's test command, configs load, the benchmark
tool keeps its interface."""

import json
import re
import subprocess
import sys

from conftest import ROOT
from odb.batching.config import load_odb_config

BENCH_KEYS = {"policy", "world_size", "samples", "emitted", "duplicated", "dropped", "truncated", "steps",
              "micro_batches", "dummy_micro_batches", "real_tokens", "materialized_tokens", "padding_ratio",
              "lower_bound_micro_batches", "aligned", "rounds", "collectives", "sync_efficiency",
              "us_per_sample"}


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for line in blocks[0].splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in readme_commands() if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_odb_config_file_loads():
    assert load_odb_config(ROOT / "configs" / "odb.json").max_tokens == 2048


def run_bench(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_batching.py"), *args, "--json",
                           "--repeat", "1"], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_tool_prints_one_json_object_with_the_documented_keys(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{(i * 7919) % 3000 + 20} {(i * 31) % 5}\n" for i in range(3000)))
    for policy in ("odb", "fixed", "gmt", "bmt"):
        report = run_bench("--lengths", str(trace), "--max-tokens", "4096", "--window", "128",
                           "--world-size", "4", "--gas", "2", "--policy", policy)
        assert set(report) == BENCH_KEYS
        assert report["aligned"] and report["emitted"] == 3000 and report["duplicated"] == 0
        assert report["collectives"] == report["rounds"] + 1
    assert report["padding_ratio"] > 0  # bmt pads
    quota = run_bench("--lengths", str(trace), "--mode", "quota", "--quota", "4500", "--window", "64")
    assert quota["emitted"] == 4500 and quota["duplicated"] == 0


def test_bench_tool_takes_explicit_rank_shards(tmp_path):
    shards = tmp_path / "ranks.json"
    shards.write_text(json.dumps({"ranks": [[100] * 3, [], [50] * 300, [[300, 4]] * 7]}))
    report = run_bench("--rank-lengths", str(shards), "--max-tokens", "1024", "--window", "32", "--gas", "2")
    assert report["world_size"] == 4 and report["samples"] == 310 and report["emitted"] == 310
    assert report["aligned"] and report["padding_ratio"] == 0
