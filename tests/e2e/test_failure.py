"""A run that fails mid-way: it exits non-zero, no process of it outlives it, and its
metrics.jsonl holds every step it trained."""

import json
import time

import psutil

from launch import ROOT, deepspeed_watched, ds_config, odb_config
from odb.batching.stream import epoch_order


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def still_running(processes: list[psutil.Process], grace_s: float = 20.0) -> list[psutil.Process]:
    """Those of ``processes`` still alive after ``grace_s`` (zombies count as ended)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def test_a_run_that_fails_mid_way_exits_non_zero_leaves_no_workers_and_keeps_its_metrics(tmp_path):
    """120 chats, one not JSON, placed 3/4 into the shared stream: under --strict the ranks train
    some steps, then every rank stops at the round that fetches it."""
    num_chats = 120
    chats = (ROOT / "data" / "chat.jsonl").read_text().splitlines()[:num_chats]
    bad = int(epoch_order(0, 0, num_chats)[90])  # the dataset index at stream position 90 (seed 0)
    chats[bad] = "{not json"
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(chats) + "\n")
    out = tmp_path / "out"
    code, output, seen = deepspeed_watched([
        "--data", str(data), "--strict", "--audit_ids", "--num_workers", "1", "--output_dir", str(out),
        "--deepspeed_config", str(ds_config(tmp_path, 2)),
        "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=8, lookahead=8))])
    assert code != 0, output[-3000:]
    assert f"DataError: {data}:{bad + 1}: not_json" in output, output[-3000:]
    assert not (out / "summary.json").exists()

    trained = sorted({row["step"] for row in lines(out / "emitted_ids.rank0.jsonl")})
    assert len(trained) >= 3, "the record should stop the run mid-way, after some steps"
    assert [row["step"] for row in lines(out / "metrics.jsonl")] == trained  # every step, once

    command = {p.pid: cmd for p, _, cmd in seen}
    is_rank = {p.pid: "--local_rank" in cmd for p, _, cmd in seen}
    ranks = {p.pid for p, parent, _ in seen if is_rank[p.pid] and not is_rank.get(parent, False)}
    workers = [p for p, parent, cmd in seen if parent in ranks and cmd == command[parent]]  # forked by a rank
    assert len(ranks) == 2 and workers, [cmd for _, _, cmd in seen]  # DataLoader workers did run
    assert not still_running([p for p, _, _ in seen])
