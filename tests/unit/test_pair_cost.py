"""A preference pair's cost and padding as the model takes it: two sequences, packed as two
segments, padded as two rows each as long as the micro-batch's longest sequence.

The oracle builds the rows as the engine does (:func:`odb.data.preference.pair_sequences`, then
:func:`odb.data.collate.collate_padded` or :func:`~odb.data.collate.collate_packed`) from the real
pairs of ``data/preference.jsonl`` and counts them; it never asks the cost model."""

from collections import Counter

import pytest

from conftest import ROOT, bundled_tokenizer
from odb.batching.align import SimulatedGroup
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.cost import CostModel, OverCapError
from odb.batching.fit import features
from odb.batching.packer import FixedPacker
from odb.batching.plan import MicroBatch, StepPlan
from odb.batching.state import decode_steps, encode_steps
from odb.data.collate import collate_packed, collate_padded
from odb.data.feed import SampleFeed
from odb.data.preference import pair_sequences
from odb.data.processing import SampleDataset, sample_sizes
from odb.telemetry.totals import RunTotals

ATTN = 2.0 ** -7  # (a binary fraction: the oracle's sums are exact floats)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return SampleDataset(ROOT / "data" / "preference.jsonl", bundled_tokenizer(), pairs=True,
                         cache_dir=tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def samples(dataset):
    return [dataset[i] for i in range(len(dataset))]


def admitted(cost_model, samples):
    costs, outcomes = cost_model.measure_many([int(s["uid"]) for s in samples], [sample_sizes(s) for s in samples])
    assert len(costs) == len(samples) and not outcomes["truncated"]
    return costs


def padded_rows(samples):
    """The padded batch the engine trains: each pair's chosen and rejected as rows of their own."""
    return collate_padded([sequence for s in samples for sequence in pair_sequences(s)], pad_token_id=0)


def groups(samples, size):
    return [samples[i:i + size] for i in range(0, len(samples), size)]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_padded_micro_batch_of_pairs_counts_the_rows_the_model_takes(samples, size):
    cost_model = CostModel(max_tokens=1 << 20, attn_coef=ATTN)
    undercounts = 0
    for group in groups(samples, size):
        batch = padded_rows(group)
        rows, width = batch["input_ids"].shape
        micro = MicroBatch(tuple(admitted(cost_model, group)), padded=True)
        assert rows == 2 * len(group)
        assert micro.materialized == rows * width
        assert micro.tokens == int(batch["attention_mask"].sum())
        assert features(micro)[:2] == (rows * width, rows * width * width)
        packer = FixedPacker(cost_model, batch_size=size)
        packer.add(list(micro.samples))
        packer.pack(window=size, is_exhausted=True)
        (bin_,) = packer.bins
        assert bin_.materialized == rows * width
        assert bin_.cost == rows * round(width + ATTN * width * width)  # every row a sequence of width tokens
        undercounts += micro.materialized > len(group) * max(len(s["input_ids"]) for s in group)
    assert undercounts  # (B x the longest pair, the count before pairs had rows, is off on this data)


def test_a_packed_pair_is_priced_as_its_two_sequences_apart(samples):
    cost_model = CostModel(max_tokens=1 << 20, attn_coef=ATTN)
    for sample, cost in zip(samples, admitted(cost_model, samples), strict=True):
        chosen, rejected = pair_sequences(sample)
        apart = admitted(cost_model, [chosen, rejected])
        assert cost.tokens == sum(s.tokens for s in apart) and cost.label_tokens == sum(s.label_tokens for s in apart)
        assert abs(cost.cost - sum(s.cost for s in apart)) <= 1  # (each rounded to an int)
        c, r = len(chosen["input_ids"]), len(rejected["input_ids"])
        (whole,), _ = cost_model.measure_many([0], [(c + r, cost.label_tokens, 0)])  # one sequence of c + r
        assert abs(whole.cost - cost.cost - ATTN * 2 * c * r) <= 1  # (c + r)^2 - c^2 - r^2 = 2 c r


def test_the_fit_sees_a_packed_micro_batch_of_pairs_as_its_segments(samples):
    cost_model = CostModel(max_tokens=1 << 20)
    for group in groups(samples, 5):
        batch = collate_packed([sequence for s in group for sequence in pair_sequences(s)])
        bounds = batch["cu_seq_lens_q"].tolist()
        micro = MicroBatch(tuple(admitted(cost_model, group)))
        assert len(bounds) == 2 * len(group) + 1
        assert features(micro)[:2] == (bounds[-1], sum((b - a) ** 2 for a, b in zip(bounds, bounds[1:])))
        assert micro.materialized == batch["input_ids"].numel()


def test_a_two_rank_fixed_run_reports_the_padding_of_its_rows(dataset):
    """policy fixed, batch_size 2, 2 simulated ranks over data/preference.jsonl (the run of
    docs/benchmarks.md "A real run on CPU", without the model): summary.json's padding_ratio,
    from the run totals, against the rows of every micro-batch the engine would collate."""
    config = OdbConfig(max_tokens=2048, window=16, gas=1, policy="fixed", batch_size=2, sharding="static",
                       cost_model="manual")

    def rank_main(comm):
        feed = SampleFeed(dataset, sample_sizes, num_workers=0)
        batcher = OnlineBatcher(config, comm, dataset_size=len(dataset), feed=feed, num_epochs=2)
        totals, real, materialized = RunTotals(rank=comm.rank, dataset_size=len(dataset)), 0, 0
        for step in batcher:
            totals.record(step)
            for micro in step.micro_batches:
                if micro.samples:
                    batch = padded_rows([feed.take(uid) for uid in micro.uids])
                    real += int(batch["attention_mask"].sum())
                    materialized += batch["input_ids"].numel()
        feed.close()
        return totals, real, materialized

    ranks = SimulatedGroup(2, timeout_s=120).run(rank_main)
    real, materialized = sum(r[1] for r in ranks), sum(r[2] for r in ranks)
    sums = {key: sum(t.counts[key] for t, _, _ in ranks) for key in ranks[0][0].counts}
    summary = ranks[0][0].summary({**sums, "dropped": 0}, world_size=2, epochs=2, rounds=0, collectives=0,
                                  policy="fixed", losses=[], max_tokens=config.max_tokens,
                                  records={"truncated": Counter(), "skipped": {}, "fetched": 2 * len(dataset)})
    assert summary["samples_emitted"] == 2 * len(dataset)
    assert (summary["real_tokens"], summary["materialized_tokens"]) == (real, materialized)
    assert summary["padding_ratio"] == round(1 - real / materialized, 6)


def test_a_plan_of_pairs_survives_its_state_and_a_single_sequence_row_keeps_five_fields(samples):
    cost_model = CostModel(max_tokens=1 << 20, attn_coef=ATTN)
    pairs = admitted(cost_model, samples[:2])
    single = admitted(cost_model, pair_sequences(samples[2]))
    plan = StepPlan(epoch=0, step=0, micro_batches=(MicroBatch(tuple(pairs), padded=True), MicroBatch(tuple(single))),
                    num_label_tokens=1, num_samples=4, rank_costs=((1, 1),), rank_tokens=((1, 1),))
    rows = encode_steps([plan])
    assert decode_steps(rows) == [plan]
    assert [len(s) for micro in rows[0]["micro"] for s in micro[1]] == [6, 6, 5, 5]


def test_a_pair_over_the_cap_is_not_cut_by_the_batcher(samples):
    sizes = sample_sizes(samples[0])
    with pytest.raises(OverCapError, match="data layer"):
        CostModel(max_tokens=sizes.tokens - 1, over_cap="truncate").measure(0, *sizes)
    sample, outcome = CostModel(max_tokens=sizes.tokens - 1, over_cap="drop").measure(0, *sizes)
    assert sample is None and outcome == "dropped"


def test_a_held_pair_measured_again_keeps_or_gains_its_second_sequence(samples):
    cost_model = CostModel(max_tokens=1 << 20, attn_coef=ATTN)
    (pair,) = admitted(cost_model, samples[:1])
    sizes = sample_sizes(samples[0])
    assert cost_model.measure_again(pair, sizes) is pair
    written_before = pair._replace(second=0, cost=cost_model.cost(pair.tokens))  # a state of an odb before pairs
    assert cost_model.measure_again(written_before, sizes) == pair
    assert cost_model.measure_again(written_before, tuple(sizes[:3])) is written_before  # (a feed of three fields)
