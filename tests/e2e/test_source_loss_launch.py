"""2-rank runs on a mixture of named sources (ZeRO-2, the tiny model, the bundled tokenizer),
through launch/train.py's ``--data NAME=PATH ...``: ``loss/<source>`` and ``label_tokens/<source>``
rows over ``--log_steps`` intervals (the last one ending at the run's last step) that add up to the
rows' own loss and label tokens, the eval loss
per source, ``summary.json``'s ``sources``, and audit rows whose ``(source, id)`` pairs are every
record of each source once; with weights (``NAME=PATH:WEIGHT``), the trained label tokens of each
source within one micro-batch of its share, every record at least once."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from conftest import bundled_tokenizer
from launch import ROOT, audit, deepspeed, ds_config, odb_config
from odb.batching.cost import count_label_tokens
from odb.data.processing import SampleDataset

TOKENIZER = bundled_tokenizer()
WORDS = "apple river quiet rapid garden cloud summer letter hidden golden ticket pencil market orange".split()
LOG_STEPS = 2
MAX_TOKENS = 256


def short_records(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)

    def record() -> str:
        question, answer = (" ".join(rng.choices(WORDS, k=rng.randint(1, most))) for most in (6, 9))
        return json.dumps({"messages": [{"role": "user", "content": question},
                                        {"role": "assistant", "content": answer}]})

    return [record() for _ in range(count)]


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sources")
    chat = (ROOT / "data" / "chat.jsonl").read_text().splitlines()
    train = [["chat", write_lines(tmp / "chat.jsonl", chat[:30])],
             ["short", write_lines(tmp / "short.jsonl", short_records(1, 40))]]
    held = [["chat", write_lines(tmp / "chat_eval.jsonl", chat[30:36])],
            ["short", write_lines(tmp / "short_eval.jsonl", short_records(2, 8))]]
    out = tmp / "run"
    proc = deepspeed(["--deepspeed_config", str(ds_config(tmp, 2)),
                      "--odb_config", str(odb_config(tmp, max_tokens=MAX_TOKENS, window=16)),
                      "--data", *(f"{name}={path}" for name, path in train),
                      "--eval_data", *(f"{name}={path}" for name, path in held),
                      "--output_dir", str(out), "--audit_ids", "--no_final_checkpoint", "--preflight", "off",
                      "--log_steps", str(LOG_STEPS)])
    datasets = {name: SampleDataset(path, TOKENIZER, truncate_to=MAX_TOKENS) for name, path in train}
    return out, proc, datasets


def test_rows_carry_each_sources_loss_over_log_intervals(mixture_run):
    out, proc, _ = mixture_run
    steps = [r for r in rows(out) if "eval_loss" not in r]
    assert [r["step"] for r in steps] == list(range(len(steps))) and len(steps) >= 2 * LOG_STEPS
    carrying = [r for r in steps if "loss/chat" in r]
    last = len(steps) - 1  # (the run's last interval ends at its last step, whole or not)
    assert [r["step"] for r in carrying] == [s for s in range(len(steps)) if (s + 1) % LOG_STEPS == 0 or s == last]
    for row, start in zip(carrying, [0] + [r["step"] + 1 for r in carrying[:-1]]):
        interval = steps[start:row["step"] + 1]
        tokens = {name: row[f"label_tokens/{name}"] for name in ("chat", "short")}
        assert sum(tokens.values()) == sum(r["label_tokens"] for r in interval)
        assert all(tokens.values())
        # the sources' sums make up the steps' own: sum(loss x tokens) alike (rows round to 1e-6)
        by_source = sum(row[f"loss/{name}"] * n for name, n in tokens.items())
        by_step = sum(r["loss"] * r["label_tokens"] for r in interval)
        assert by_source == pytest.approx(by_step, rel=1e-5)
    last = carrying[-1]
    print(f"{len(steps)} steps; step {last['step']}: loss/chat {last['loss/chat']} over "
          f"{last['label_tokens/chat']} tokens, loss/short {last['loss/short']} over {last['label_tokens/short']}")


def test_summary_and_audit_count_each_source(mixture_run):
    out, _, datasets = mixture_run
    summary = json.loads((out / "summary.json").read_text())
    lines = [m for rank in audit(out, 2) for m in rank]
    pairs = Counter((source, i) for m in lines for source, i in zip(m["sources"], m["ids"], strict=True))
    expected = {(name, i) for name, dataset in datasets.items() for i in range(len(dataset))}
    assert set(pairs) == expected and set(pairs.values()) == {1}  # every record of each source once
    tokens = {name: sum(count_label_tokens(d[i]["labels"]) for i in range(len(d))) for name, d in datasets.items()}
    total = sum(tokens.values())
    assert summary["sources"] == {name: {"samples": len(datasets[name]), "label_tokens": tokens[name],
                                         "share": round(tokens[name] / total, 6)} for name in datasets}
    assert summary["label_tokens"] == total and summary["samples_emitted"] == len(expected)


def test_the_eval_row_has_each_sources_eval_loss(mixture_run):
    out, proc, _ = mixture_run
    evals = [r for r in rows(out) if "eval_loss" in r]
    assert len(evals) == 1
    row = evals[0]
    tokens = {name: row[f"eval_label_tokens/{name}"] for name in ("chat", "short")}
    assert sum(tokens.values()) == row["eval_label_tokens"] and all(tokens.values())
    mean = sum(row[f"eval_loss/{name}"] * n for name, n in tokens.items()) / row["eval_label_tokens"]
    assert mean == pytest.approx(row["eval_loss"], abs=2e-6)
    assert "; chat " in proc.stdout and "; short " in proc.stdout  # the eval log line names them


def test_a_weighted_mixture_trains_each_sources_share_of_label_tokens(tmp_path):
    chat = (ROOT / "data" / "chat.jsonl").read_text().splitlines()
    train = {"chat": write_lines(tmp_path / "chat.jsonl", chat[:40]),
             "short": write_lines(tmp_path / "short.jsonl", short_records(3, 60))}
    weights = {"chat": 0.3, "short": 0.7}  # the short records carry far fewer label tokens: up-sampled
    out = tmp_path / "run"
    deepspeed(["--deepspeed_config", str(ds_config(tmp_path, 2)),
               "--odb_config", str(odb_config(tmp_path, max_tokens=MAX_TOKENS, window=16)),
               "--data", *(f"{name}={path}:{weights[name]}" for name, path in train.items()),
               "--output_dir", str(out), "--audit_ids", "--no_final_checkpoint", "--preflight", "off"])
    datasets = {name: SampleDataset(path, TOKENIZER, truncate_to=MAX_TOKENS) for name, path in train.items()}
    trained = Counter()
    times = Counter()
    for m in (m for rank in audit(out, 2) for m in rank):
        for source, i in zip(m["sources"], m["ids"], strict=True):
            trained[source] += count_label_tokens(datasets[source][i]["labels"])
            times[source, i] += 1
    total = sum(trained.values())
    for name, weight in weights.items():  # within one micro-batch of the exact share
        assert abs(trained[name] - weight * total) <= MAX_TOKENS, (dict(trained), weights)
        assert all(times[name, i] >= 1 for i in range(len(datasets[name])))  # every record at least once
    summary = json.loads((out / "summary.json").read_text())
    assert {name: v["label_tokens"] for name, v in summary["sources"].items()} == dict(trained)
    print(f"shares {{{', '.join(f'{n}: {trained[n] / total:.4f}' for n in weights)}}} of {total} label tokens; "
          f"short records trained {sum(v for (n, _), v in times.items() if n == 'short')} times for "
          f"{len(datasets['short'])} records")
