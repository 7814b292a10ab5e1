"""Faults with real processes: a rank frozen, killed on "another node" (no launcher sees it), a
DataLoader worker that hangs. Every other rank must exit non-zero, ended by odb's watchdog after
``--dist_timeout_s`` (its output names the rank and the exit code), not left hanging; a run
resumed from its last checkpoint loses nothing. How long the ending took is printed, not judged:
a loaded machine stretches it; ``HANG_S`` only stops a test whose ranks never end."""

from __future__ import annotations

import json
import time
from collections import Counter

import psutil

from launch import Run, audit, deepspeed, ds_config, odb_config, steps_trained
from odb.batching.fit import MIN_OBSERVATIONS
from odb.training.run.watchdog import EXIT_STALLED

TIMEOUT_S = 10
HANG_S = 300  # a bound against a hang only (the watchdog ends the ranks some 10-20 s after the fault)


def args(tmp_path, out, *extra):
    return ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--odb_config",
            str(odb_config(tmp_path, max_tokens=1024, window=32, lookahead=16)), "--output_dir", str(out),
            "--audit_ids", "--dist_timeout_s", str(TIMEOUT_S), *extra]


def ended(processes, since: float) -> float:
    """Seconds from ``since`` until every process has ended (a zombie, not yet reaped by its
    launcher, has ended)."""
    deadline = since + HANG_S
    while time.monotonic() < deadline:
        try:
            if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in processes):
                return time.monotonic() - since
        except psutil.NoSuchProcess:
            continue
        time.sleep(0.2)
    raise AssertionError("still running")


def ended_within(run: Run, injected: float, ranks: list[int]) -> tuple[list[int], float]:
    """The exit codes of ``ranks`` (processes of a run ``apart``) and when the last ended."""
    codes = []
    for rank in ranks:
        codes.append(run.procs[rank].wait(HANG_S))
    return codes, time.monotonic() - injected


def test_a_frozen_rank_ends_every_rank_within_the_timeout(tmp_path):
    """SIGSTOP on rank 1 of 3 (a rank stuck in I/O looks the same): ranks 0 and 2 end with
    EXIT_STALLED, naming rank 1, its step and round; then the launcher ends non-zero."""
    out = tmp_path / "out"
    run = Run(args(tmp_path, out), nproc=3)
    try:
        run.wait_for(lambda: steps_trained(out) >= 3)
        frozen = run.rank_process(1)
        others = [run.rank_process(0), run.rank_process(2)]
        frozen.suspend()
        elapsed = ended(others, time.monotonic())
        frozen.kill()  # what the launcher does 30 s after its SIGTERM (a stopped process ignores it)
        codes = run.wait(60)
    finally:
        run.kill()
    output = run.output()
    print(f"frozen rank: the others ended {elapsed:.1f} s after SIGSTOP; launcher exit {codes}")
    print("\n".join(line for line in output.splitlines() if "watchdog" in line))
    assert codes[0] != 0
    assert "rank 1 stopped answering: no heartbeat" in output, output[-3000:]
    assert f"exit code {EXIT_STALLED}" in output


def test_a_rank_killed_on_another_node_ends_the_others_and_a_resume_loses_nothing(tmp_path):
    """3 ranks, each its own process (no launcher over them), a checkpoint every 2 steps: rank 2
    killed with SIGKILL between checkpoints. Ranks 0 and 1 end non-zero, naming rank 2 (on gloo the
    broken connection fails their collective at once; where a collective would hang instead, the
    watchdog ends them with EXIT_STALLED, as the frozen-rank test shows); resumed from the
    last checkpoint, every sample trains at least once over both runs, and everything after the
    checkpoint exactly once."""
    out = tmp_path / "out"
    fit = ("--cost_model", "fit")  # the fitted cost model: its state rides in the checkpoint
    run = Run(args(tmp_path, out, "--max_samples", "600", "--save_steps", "2", *fit), nproc=3, apart=True)
    try:
        run.wait_for(lambda: steps_trained(out) >= 5 and steps_trained(out) % 2 == 1)
        run.rank_process(2).kill()
        injected = time.monotonic()
        codes, elapsed = ended_within(run, injected, [0, 1])
    finally:
        run.kill()
    output = run.output()
    print(f"killed rank: the others ended {elapsed:.1f} s after SIGKILL, exit codes {codes}")
    print("\n".join(line for line in output.splitlines() if "watchdog" in line))
    assert all(code != 0 for code in codes), output[-3000:]
    assert "rank(s) [2] stopped answering" in output, output[-3000:]
    first = audit(out, 3)
    saved = int((out / "checkpoints" / "latest").read_text().strip()[4:])
    trained_before = max(row["step"] for rows in first for row in rows) + 1
    assert trained_before > saved, "the kill should fall between checkpoints"

    fit_state = json.loads((out / "checkpoints" / f"step{saved}" / "odb_state.rank0.json").read_text())["fit"]
    assert fit_state["window"] or fit_state["unsent"], "the checkpoint holds the cost fit's micro-batch times"
    deepspeed(args(tmp_path, out, "--max_samples", "600", "--save_steps", "2", "--resume", *fit), nproc=3)
    first_rows = sum(len(r) for r in first)
    history = Counter(i for rank_rows in audit(out, 3) for row in rank_rows for i in row["ids"])
    assert set(history) == set(range(600)), "every sample trained at least once"
    resumed = [row for r, rank_rows in enumerate(audit(out, 3)) for row in rank_rows[len(first[r]):]]
    kept = [row for rank_rows in first for row in rank_rows if row["step"] < saved]
    exact = Counter(i for row in kept + resumed for i in row["ids"])
    assert exact == Counter(range(600)), "from the checkpoint on, every sample exactly once"
    assert min(row["step"] for row in resumed) == saved
    assert first_rows > len(kept)  # the lost steps were trained again
    cost_model = json.loads((out / "summary.json").read_text())["cost_model"]
    assert cost_model["mode"] == "fit" and cost_model["fit_micro_batches"] >= MIN_OBSERVATIONS, cost_model


def test_a_stuck_dataloader_worker_ends_every_rank(tmp_path):
    """SIGSTOP on rank 1's DataLoader worker: rank 1 waits for samples for ever, the others wait
    on rank 1 in odb's round. Every rank ends with EXIT_STALLED, naming rank 1 and what it did."""
    out = tmp_path / "out"
    run = Run(args(tmp_path, out, "--num_workers", "1", "--prefetch_factor", "1"), nproc=3)
    try:
        run.wait_for(lambda: steps_trained(out) >= 2)
        rank1 = run.rank_process(1)
        workers = [c for c in rank1.children() if c.cmdline() == rank1.cmdline()]
        assert workers, "rank 1 has a DataLoader worker"
        for worker in workers:
            worker.suspend()
        elapsed = ended([run.rank_process(r) for r in (0, 2)] + [rank1], time.monotonic())
        for worker in workers:
            worker.kill()  # the launcher's SIGTERM to the tree would wait 30 s on a stopped worker
        codes = run.wait(60)
    finally:
        run.kill()
    output = run.output()
    print(f"stuck worker: every rank ended {elapsed:.1f} s after SIGSTOP; launcher exit {codes}")
    print("\n".join(line for line in output.splitlines() if "watchdog" in line))
    assert codes[0] != 0
    assert "rank 1 made no progress" in output and "fetching samples" in output, output[-3000:]


def test_ranks_started_with_different_settings_stop_at_start_naming_keys_and_ranks(tmp_path):
    """Two ranks apart (as on two nodes), rank 1 started with other data and another learning rate:
    both stop at start, before any step, naming the keys and the rank that differs."""
    out = tmp_path / "out"
    run = Run(args(tmp_path, out, "--max_samples", "100"), nproc=2, apart=True,
              rank_args={1: ["--max_samples", "90", "--lr", "0.002"]})
    codes = run.wait(300)
    output = run.output()
    assert codes[0] != 0 and codes[1] != 0, output[-3000:]
    assert "SettingsMismatch: ranks were started with different settings" in output, output[-3000:]
    for key in ("'data.fingerprint': rank(s) [1]", "'dataset_size': rank(s) [1]", "'optimizer': rank(s) [1]"):
        assert key in output, output[-3000:]
    assert steps_trained(out) == 0
