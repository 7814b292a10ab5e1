"""A mixture's per-source figures under a preference objective: each source's pair losses, label
tokens and pairs from the steps (odb.training.step.preference.PreferenceTally), the metrics rows'
``loss/<source>`` as a mean over the source's pairs with ``pairs/<source>`` beside it, summary.json's
per-source samples and label tokens, and an evaluation's ``eval_loss/<source>``. The oracle: each
pair's loss scored alone (its own micro-batch), summed per source by hand."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from odb.batching.cost import SampleCost, count_label_tokens
from odb.batching.plan import MicroBatch, StepPlan
from odb.telemetry import StepTimes, Telemetry
from odb.training.backends import LocalBackend
from odb.training.model.build import build_model
from odb.training.step.engine import OdbEngine
from odb.training.step.preference import Preference
from odb.training.step.sources import SourceSums
from preference_oracle import pair

ROOT = Path(__file__).resolve().parents[2]
OBJECTIVE = Preference("simpo", beta=2.0, gamma=0.5, reference="none")
TIMES = StepTimes(wait=0, plan=0, collective=0, step=1.0, ended=0.0)


def cost(sample: dict) -> SampleCost:
    return SampleCost(sample["uid"], len(sample["input_ids"]), count_label_tokens(sample["labels"].tolist()), 0, 0)


def step_plan(micro_samples: list[list[dict]], step: int = 0) -> StepPlan:
    micro = tuple(MicroBatch(tuple(cost(s) for s in samples)) for samples in micro_samples)
    return StepPlan(epoch=0, step=step, micro_batches=micro, num_label_tokens=sum(m.label_tokens for m in micro),
                    num_samples=sum(map(len, micro_samples)), rank_costs=((1,),) * len(micro),
                    rank_tokens=tuple((m.tokens,) for m in micro))


@pytest.fixture(scope="module")
def engine():
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=1024)
    return OdbEngine(LocalBackend(model), world_size=1, max_tokens=512, pad_token_id=0, loss_chunk_tokens=64,
                     objective=OBJECTIVE)


@pytest.fixture(scope="module")
def micro_samples():
    rng = random.Random(3)
    samples = [pair(rng, uid, ref=False) for uid in range(5)]
    for sample, source in zip(samples, (0, 1, 1, 0, 1)):
        sample["source"] = source
    return [samples[:3], samples[3:]]


def alone(engine, sample: dict) -> float:
    with torch.no_grad():
        losses, _ = OBJECTIVE.pairs(engine, MicroBatch((cost(sample),)), [sample])
    return float(losses[0])


def by_hand(engine, micro_samples) -> tuple[list[float], list[int], list[int]]:
    loss, tokens, pairs = [0.0, 0.0], [0, 0], [0, 0]
    for sample in (s for micro in micro_samples for s in micro):
        loss[sample["source"]] += alone(engine, sample)
        tokens[sample["source"]] += cost(sample).label_tokens
        pairs[sample["source"]] += 1
    return loss, tokens, pairs


def test_a_step_reports_each_sources_pair_losses_label_tokens_and_pairs(engine, micro_samples):
    plan = step_plan(micro_samples)
    tally = engine.tally(plan)
    for micro, samples in zip(plan.micro_batches, micro_samples, strict=True):
        tally.loss(micro, samples).backward()
    result = tally.result(lr=0.0)
    loss, tokens, pairs = by_hand(engine, micro_samples)
    assert result.source_samples == (2, 3) and result.source_label_tokens == tuple(tokens)
    assert result.source_loss == pytest.approx(loss, rel=1e-5)
    assert math.fsum(result.source_loss) == pytest.approx(result.loss_sum, rel=1e-9)


STEPS = [((1.0, 6.0), (30, 50), (1, 2)), ((2.0, 0.0), (40, 0), (2, 0))]  # loss, label tokens, pairs per source


def telemetry_of(out: Path, state: dict | None = None) -> Telemetry:
    out.mkdir(parents=True, exist_ok=True)
    telemetry = Telemetry(rank=0, max_steps_per_round=4, max_tokens=512, dataset_size=5, output_dir=out)
    telemetry.set_sources(("a", "b"), every=2)
    if state is not None:
        telemetry.load_state_dict(state)
    return telemetry


def train(telemetry: Telemetry, steps: range) -> None:
    for step in steps:
        loss, tokens, pairs = STEPS[step]
        sample = SampleCost(uid=step, tokens=100, label_tokens=sum(tokens), patches=0, cost=100)
        plan = StepPlan(epoch=0, step=step, micro_batches=(MicroBatch((sample,)),), num_label_tokens=sum(tokens),
                        num_samples=sum(pairs), rank_costs=((100,),), rank_tokens=((100,),))
        telemetry.record(plan, loss_sum=sum(loss), lr=0.1, times=TIMES, source_loss=loss, source_label_tokens=tokens,
                         source_samples=pairs, rewards=(0.0, 0.0, 0))
    telemetry.on_reports(np.stack([telemetry.report({})]))


def finish(telemetry: Telemetry, out: Path) -> list[dict]:
    telemetry.end_interval()
    telemetry.on_final_reports(np.stack([telemetry.final_report({}, dropped=0)]))
    telemetry.close()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_rows_give_each_sources_mean_pair_loss_and_the_summary_its_pairs(tmp_path):
    telemetry = telemetry_of(tmp_path)
    train(telemetry, range(2))
    rows = finish(telemetry, tmp_path)
    carrying = [r for r in rows if "loss/a" in r]
    assert len(carrying) == 1 and carrying[0]["step"] == 1
    # per pair, as the step's loss: a's 3 pairs lost 3.0, b's 2 pairs 6.0
    assert carrying[0]["loss/a"] == pytest.approx(1.0) and carrying[0]["loss/b"] == pytest.approx(3.0)
    assert (carrying[0]["pairs/a"], carrying[0]["pairs/b"]) == (3, 2) and "label_tokens/a" not in carrying[0]
    assert telemetry.source_totals == ([3, 2], [70, 50])  # summary.json's samples and label tokens per source


def test_an_evaluation_gives_each_sources_mean_pair_loss(engine, micro_samples):
    plan = step_plan(micro_samples)
    sums = SourceSums(engine.device)
    with torch.no_grad():
        total, count = engine.eval_step(plan, micro_samples, by_source=sums)
    loss, _, pairs = by_hand(engine, micro_samples)
    got_loss, got_pairs, got_samples = sums.read()
    assert count == 5 and got_pairs == pairs == got_samples
    assert got_loss == pytest.approx(loss, rel=1e-5) and math.fsum(got_loss) == pytest.approx(total, rel=1e-9)


def test_a_resumed_open_interval_stays_per_pair_where_it_closes_before_any_step(tmp_path):
    first = telemetry_of(tmp_path / "1")
    train(first, range(1))  # step 0 of an interval of 2: open at the checkpoint
    state = json.loads(json.dumps(first.state_dict({}, {})))
    resumed = telemetry_of(tmp_path / "2", state)
    resumed.on_reports(np.stack([resumed.report({})]))  # a stop before its first step
    carrying = [r for r in finish(resumed, tmp_path / "2") if "loss/a" in r]
    assert carrying and carrying[0]["pairs/a"] == 1 and carrying[0]["loss/b"] == pytest.approx(3.0)
