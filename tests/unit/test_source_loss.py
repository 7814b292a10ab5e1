"""Per-source loss (a data mixture): each source's summed token loss, split from the packed rows'
token losses, against the model's own loss on each sample alone (STYLE 16: an eager copy of the
model, its own ``labels=`` loss times its label count, summed per source). Two sources of chat
records through the bundled tokenizer (:class:`odb.data.mixture.MixedDataset`), the tiny model,
rows that interleave the sources, with the full-logits loss and the chunked loss (chunks that
straddle samples), a padded micro-batch, Liger's per-source calls (a stand-in), the eval loss per
source through the Evaluator; then the telemetry: ``loss/<source>`` rows over log intervals, the
run's per-source totals in the summary, the audit's ids and sources."""

from __future__ import annotations

import copy
import io
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import bundled_tokenizer
from odb.batching.align import SimulatedGroup
from odb.batching.config import OdbConfig
from odb.batching.cost import SampleCost, count_label_tokens
from odb.batching.plan import MicroBatch, StepPlan
from odb.data.collate import collate_packed, collate_padded, token_sources
from odb.data.mixture import MixedDataset
from odb.data.processing import SampleDataset
from odb.telemetry import StepTimes, Telemetry
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model, hf_model
from odb.training.run.evaluate import Evaluator
from odb.training.run.loop import Trainer
from odb.training.step.engine import OdbEngine

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = bundled_tokenizer()
WORDS = ("apple river quiet rapid garden cloud summer letter hidden golden ticket pencil market orange "
         "morning feather music silver evening rocket pocket stone tunnel castle dragon candle").split()
TOLERANCE = 1e-5  # per-source loss (per label token), odb's packed rows against each sample alone


def records(seed: int, count: int, words: int) -> list[dict]:
    """Chat records; ``words`` sets how long the answers run (the two sources differ)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
        answer = " ".join(rng.choices(WORDS, k=rng.randint(1, words)))
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> MixedDataset:
    folder = tmp_path_factory.mktemp("sources")
    alpha = SampleDataset(write_jsonl(folder / "alpha.jsonl", records(1, 6, 6)), TOKENIZER)
    beta = SampleDataset(write_jsonl(folder / "beta.jsonl", records(2, 5, 30)), TOKENIZER)
    return MixedDataset([("alpha", alpha), ("beta", beta)])


@pytest.fixture(scope="module")
def model():
    return build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=len(TOKENIZER))


def alone_by_source(model, samples: list[dict], num_sources: int) -> tuple[list[float], list[int]]:
    """The oracle: on an eager copy of ``model``, each sample alone, the model's own loss (its mean
    over the shifted labels) times its label count; summed per source (float64)."""
    oracle = copy.deepcopy(model)
    hf_model(oracle).set_attn_implementation("eager")
    sums, counts = [0.0] * num_sources, [0] * num_sources
    with torch.no_grad():
        for sample in samples:
            ids, labels = torch.as_tensor(sample["input_ids"])[None], torch.as_tensor(sample["labels"])[None]
            count = int((labels[0, 1:] != -100).sum())
            if count:
                loss = oracle(input_ids=ids, labels=labels, use_cache=False).loss
                sums[sample["source"]] += float(loss) * count
            counts[sample["source"]] += count
    return sums, counts


def costs(samples: list[dict]) -> tuple[SampleCost, ...]:
    return tuple(SampleCost(uid=int(s["uid"]), tokens=len(s["input_ids"]), label_tokens=count_label_tokens(s["labels"]),
                            patches=0, cost=0) for s in samples)


def interleaved(mixture: MixedDataset) -> list[list[dict]]:
    """Micro-batches whose rows mix the sources: alpha, beta, alpha, ... several samples per row;
    the last one padded rows."""
    alpha = [mixture[i] for i in range(6)]
    beta = [mixture[i] for i in range(6, 11)]
    assert {s["source"] for s in alpha} == {0} and {s["source"] for s in beta} == {1}
    return [[alpha[0], beta[0], alpha[1], beta[1], alpha[2]], [beta[2], alpha[3], beta[3]], [alpha[4], beta[4]],
            [alpha[5]]]


def step(mixture: MixedDataset, micro_samples: list[list[dict]], *, padded_last: bool = True) -> StepPlan:
    micro = [MicroBatch(costs(s), padded=padded_last and i == len(micro_samples) - 2)
             for i, s in enumerate(micro_samples)]
    tokens = sum(m.label_tokens for m in micro)
    return StepPlan(epoch=0, step=0, micro_batches=(*micro, MicroBatch(())), num_label_tokens=tokens,
                    num_samples=sum(len(s) for s in micro_samples), rank_costs=(), rank_tokens=())


def engine_of(model, chunk_tokens: int | None, max_tokens: int = 512) -> OdbEngine:
    return OdbEngine(LocalBackend(model), world_size=1, max_tokens=max_tokens, pad_token_id=0,
                     loss_chunk_tokens=chunk_tokens)


def run_tally(engine: OdbEngine, plan: StepPlan, micro_samples: list[list[dict]], *, backward: bool = False):
    tally = engine.tally(plan)
    for micro, samples in zip(plan.micro_batches, [*micro_samples, []]):
        loss = tally.loss(micro, samples)
        if backward:
            loss.backward()
    return tally.result(lr=0.0)


# ---- collate ------------------------------------------------------------------------------------

def test_token_sources_spread_each_samples_source_over_its_tokens():
    samples = [{"input_ids": [1, 2, 3], "source": 1}, {"input_ids": [4, 5], "source": 0}, {"input_ids": [6]}]
    packed = collate_packed(samples, sources=True)
    assert packed["sources"].tolist() == [1, 0, 0]  # a sample without a source: 0
    assert token_sources(packed).tolist() == [[1, 1, 1, 0, 0, 0]]
    padded = collate_padded(samples, pad_token_id=0, sources=True)
    assert token_sources(padded).tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert "sources" not in collate_packed(samples) and "sources" not in collate_padded(samples, pad_token_id=0)


# ---- training: the engine's per-source sums -----------------------------------------------------

@pytest.mark.parametrize("chunk_tokens", [None, 16, 1024], ids=["full-logits", "chunks-16", "one-chunk"])
def test_per_source_train_loss_equals_each_sample_alone(mixture, model, chunk_tokens):
    micro_samples = interleaved(mixture)
    plan = step(mixture, micro_samples)
    result = run_tally(engine_of(model, chunk_tokens), plan, micro_samples)
    expected, counts = alone_by_source(model, [s for m in micro_samples for s in m], 2)
    assert list(result.source_label_tokens) == counts and sum(counts) == result.label_tokens
    assert list(result.source_samples) == [6, 5]
    per_token = [abs(a / n - e / n) for a, e, n in zip(result.source_loss, expected, counts)]
    print(f"chunks {chunk_tokens}: per-source loss {[round(a / n, 6) for a, n in zip(result.source_loss, counts)]}"
          f", alone {[round(e / n, 6) for e, n in zip(expected, counts)]}, max abs diff {max(per_token):.2e}")
    assert max(per_token) <= TOLERANCE
    assert sum(result.source_loss) == pytest.approx(result.loss_sum, rel=1e-6)
    assert abs(result.source_loss[0] / counts[0] - result.source_loss[1] / counts[1]) > 0.01  # two sources apart


@pytest.mark.parametrize("chunk_tokens", [None, 16], ids=["full-logits", "chunks-16"])
def test_the_split_leaves_the_backed_loss_and_its_gradients_as_they_were(mixture, model, chunk_tokens):
    """The same samples without sources (one source: no split) back the same loss and gradients."""
    micro_samples = interleaved(mixture)
    plain = [[{k: v for k, v in s.items() if k != "source"} for s in m] for m in micro_samples]
    grads, losses = [], []
    for samples in (micro_samples, plain):
        model.zero_grad()
        losses.append(run_tally(engine_of(model, chunk_tokens), step(mixture, samples), samples, backward=True))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad()
    assert losses[0].loss_sum == pytest.approx(losses[1].loss_sum, rel=1e-6)
    assert losses[1].source_loss == (pytest.approx(losses[1].loss_sum),)  # no source: all of it source 0
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / grads[1][n].abs().max().clamp_min(1e-12))
                for n in grads[1])
    print(f"chunks {chunk_tokens}: gradients with and without the split, max rel diff {worst:.2e}")
    assert worst <= 1e-5


def test_liger_style_fused_loss_runs_once_per_source(mixture, model):
    """Where the fused loss serves (CUDA + Liger, not here), a mixed row calls it once per source
    present on that source's rows: a stand-in with the fused loss's contract (sum, -100 ignored)."""
    engine = engine_of(model, 1024)
    head = engine.head_loss.head
    calls = []

    def fused(hidden_nh, labels_n):
        calls.append(int((labels_n != -100).sum()))
        return F.cross_entropy(head(hidden_nh).float(), labels_n, ignore_index=-100, reduction="sum")

    engine.head_loss.fused = fused
    micro_samples = interleaved(mixture)
    plan = step(mixture, micro_samples, padded_last=False)
    result = run_tally(engine, plan, micro_samples)
    expected, counts = alone_by_source(model, [s for m in micro_samples for s in m], 2)
    assert max(abs(a / n - e / n) for a, e, n in zip(result.source_loss, expected, counts)) <= TOLERANCE
    # rows of both sources: one call per source; the row of alpha alone and the dummy: one call each
    assert len(calls) == 2 + 2 + 2 + 1 + 1 and sum(calls) == sum(counts)


# ---- evaluation ---------------------------------------------------------------------------------

def test_eval_loss_per_source_equals_each_sample_alone(mixture, model):
    model.eval()
    try:
        engine = engine_of(model, 16, max_tokens=36)  # beta's 40-token sample is scored whole, alone
        comm = SimulatedGroup(1).communicator(0)
        batching = OdbConfig(max_tokens=36, window=8, cost_model="manual")
        result = Evaluator(engine, mixture, batching, comm).run()
        expected, counts = alone_by_source(model, [mixture[i] for i in range(len(mixture))], 2)
    finally:
        model.train()
    assert result.samples == len(mixture) and result.over_cap == 1 and set(result.sources) == {"alpha", "beta"}
    diffs = [abs(result.sources[name][0] - e / n) for name, e, n in zip(("alpha", "beta"), expected, counts)]
    print(f"eval per source {result.sources}, over cap {result.over_cap}, max abs diff {max(diffs):.2e}")
    assert [result.sources[name][1] for name in ("alpha", "beta")] == counts
    assert max(diffs) <= TOLERANCE
    assert result.loss == pytest.approx(sum(expected) / sum(counts), abs=TOLERANCE)


# ---- telemetry: rows, summary, audit ------------------------------------------------------------

def telemetry_plan(index: int) -> StepPlan:
    sample = SampleCost(uid=index, tokens=10, label_tokens=5, patches=0, cost=10)
    return StepPlan(epoch=0, step=index, micro_batches=(MicroBatch((sample,)),), num_label_tokens=10, num_samples=2,
                    rank_costs=((10, 10),), rank_tokens=((10, 10),))


def test_rows_carry_loss_per_source_over_log_intervals_and_the_summary_the_runs_counts(tmp_path):
    """Two ranks' telemetry, their reports gathered by hand: rank 0's rows at each third step carry
    the interval's per-source loss (sums over ranks and steps / label tokens); the run's last,
    partial interval (step 6) is on the last step's row; the summary counts every step per source.
    (Resumes: tests/unit/test_source_intervals.py.)"""
    ranks = [Telemetry(rank=r, max_steps_per_round=4, max_tokens=64, dataset_size=100, output_dir=tmp_path)
             for r in range(2)]
    for telemetry in ranks:
        telemetry.set_sources(("alpha", "beta"), every=3)
    times = StepTimes(wait=0, plan=0, collective=0, step=1.0, ended=0.0)
    # step s on rank r: alpha loss (s + 1) * (r + 1) over 2 tokens, beta 10 + s over 3 tokens (rank 1: none)
    figures = {(s, r): ((2.0 * (s + 1) * (r + 1), (10.0 + s) if r == 0 else 0.0), (2, 3 if r == 0 else 0),
                        (1, 1 if r == 0 else 0)) for s in range(7) for r in range(2)}
    for first, last in ((0, 4), (4, 7)):  # steps 0-3 reported on a round, 4-6 on the final gather
        for s in range(first, last):
            for r, telemetry in enumerate(ranks):
                loss, tokens, samples = figures[s, r]
                telemetry.record(telemetry_plan(s), loss_sum=sum(loss), lr=0.1, times=times, source_loss=loss,
                                 source_label_tokens=tokens, source_samples=samples)
        if first == 0:
            gathered = np.stack([t.report({}) for t in ranks])
            for telemetry in ranks:
                telemetry.on_reports(gathered)
    assert all(t.end_interval() for t in ranks)  # the run ends (Trainer.finish), inside an interval
    final = np.stack([t.final_report({}, dropped=0) for t in ranks])
    totals = [t.on_final_reports(final) for t in ranks][0]
    summary = ranks[0].summary(totals, world_size=2, epochs=1, rounds=2, collectives=3, policy="odb")
    ranks[0].close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(7))
    with_sources = {r["step"]: r for r in rows if "loss/alpha" in r}
    assert sorted(with_sources) == [2, 5, 6]  # (6: the run's last interval, of one step)
    for first, last in ((0, 2), (3, 5), (6, 6)):
        steps = range(first, last + 1)
        alpha = sum(figures[s, r][0][0] for s in steps for r in range(2)) / (2 * 2 * len(steps))
        beta = sum(10.0 + s for s in steps) / (3 * len(steps))
        row = with_sources[last]
        assert row["loss/alpha"] == pytest.approx(alpha) and row["loss/beta"] == pytest.approx(beta)
        assert row["label_tokens/alpha"] == 4 * len(steps) and row["label_tokens/beta"] == 3 * len(steps)
    assert summary["sources"] == {"alpha": {"samples": 14, "label_tokens": 28, "share": 0.571429},
                                  "beta": {"samples": 7, "label_tokens": 21, "share": 0.428571}}


def test_a_single_source_runs_rows_are_as_before_and_its_summary_has_one_entry(tmp_path):
    telemetry = Telemetry(rank=0, max_steps_per_round=4, max_tokens=64, dataset_size=100, output_dir=tmp_path)
    layout = telemetry.layout.size
    telemetry.set_sources(("data",), every=1)
    assert telemetry.layout.size == layout  # nothing more on the wire
    times = StepTimes(wait=0, plan=0, collective=0, step=1.0, ended=0.0)
    telemetry.record(telemetry_plan(0), loss_sum=3.0, lr=0.1, times=times, source_loss=(3.0,),
                     source_label_tokens=(10,), source_samples=(2,))
    totals = telemetry.on_final_reports(telemetry.final_report({}, dropped=0)[None])
    summary = telemetry.summary(totals, world_size=1, epochs=1, rounds=0, collectives=1, policy="odb")
    telemetry.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert not [key for key in row if "/" in key]
    assert summary["sources"] == {"data": {"samples": 1, "label_tokens": 5, "share": 1.0}}


def test_audit_rows_name_each_samples_source_and_its_record_there(mixture):
    trainer = Trainer.__new__(Trainer)
    trainer.parts, trainer.audit = SimpleNamespace(dataset=mixture), io.StringIO()
    size = len(mixture)
    uids = [1, 7, size + 10, 2 * size + 3]  # alpha 1, beta 1, beta 4 (second pass), alpha 3 (third)
    trainer._audit(StepPlan(epoch=0, step=0, micro_batches=(MicroBatch(costs([mixture[u] for u in uids])),),
                            num_label_tokens=1, num_samples=4, rank_costs=(), rank_tokens=()))
    row = json.loads(trainer.audit.getvalue())
    assert row["ids"] == [1, 1, 4, 3] and row["sources"] == ["alpha", "beta", "beta", "alpha"]
    assert row["epochs"] == [0, 0, 1, 2]
