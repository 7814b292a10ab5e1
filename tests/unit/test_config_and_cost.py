import json

import pytest

from odb.batching.config import OdbConfig, load_odb_config
from odb.batching.cost import CostModel, OverCapError, count_label_tokens, sequence_parallel_degrees


@pytest.mark.parametrize("field,value,needle", [
    ("max_tokens", 0, "--max_tokens must be >= 1"),
    ("max_tokens", -5, "--max_tokens must be >= 1"),
    ("max_tokens", 8192.5, "--max_tokens must be an integer"),
    ("max_tokens", "8192", "--max_tokens must be an integer"),
    ("window", 0, "--window must be >= 1"),
    ("gas", 0, "--gas must be >= 1"),
    ("mode", "both", "--mode must be one of"),
    ("over_cap", "clip", "--over_cap must be one of"),
    ("min_fill", 1.5, "--min_fill must be within"),
])
def test_bad_settings_name_the_flag(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        OdbConfig(**{field: value})


def test_quota_mode_needs_a_quota_and_join_mode_refuses_one():
    with pytest.raises(ValueError, match="--mode quota needs --quota"):
        OdbConfig(mode="quota")
    with pytest.raises(ValueError, match="only used with --mode quota"):
        OdbConfig(quota=10)
    assert OdbConfig(mode="quota", quota=10).quota == 10


def test_json_loading_is_strict_and_names_known_keys(tmp_path):
    path = tmp_path / "odb.json"
    path.write_text(json.dumps({"max_tokens": 4096, "windw": 3}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['windw'\].*'window'"):
        load_odb_config(path)
    path.write_text(json.dumps({"max_tokens": 4096}))
    assert load_odb_config(path, window=7).to_dict() == OdbConfig(max_tokens=4096, window=7).to_dict()
    with pytest.raises(FileNotFoundError, match="configs/odb.json"):
        load_odb_config(tmp_path / "missing.json")


def test_cost_has_an_optional_quadratic_attention_term_and_patch_term():
    assert CostModel(max_tokens=100).cost(10) == 10
    assert CostModel(max_tokens=100, attn_coef=0.5).cost(10) == 10 + 50
    assert CostModel(max_tokens=100, patch_coef=2.0).cost(10, patches=3) == 16
    assert CostModel(max_tokens=100).padded_cost(4, 10) == 40


def test_over_cap_policies():
    sample, outcome = CostModel(max_tokens=8).measure(1, 12, 11)
    assert (sample.tokens, sample.label_tokens, outcome) == (8, 7, "truncated")
    assert CostModel(max_tokens=8, over_cap="drop").measure(1, 12, 11) == (None, "dropped")
    with pytest.raises(OverCapError, match="12 tokens > max_tokens=8"):
        CostModel(max_tokens=8, over_cap="error").measure(1, 12, 11)
    # an image cannot be cut: over the patch cap it is dropped even under 'truncate'
    assert CostModel(max_tokens=8, max_patches=4).measure(1, 5, 4, patches=9) == (None, "dropped")
    with pytest.raises(ValueError, match="empty"):
        CostModel(max_tokens=8).measure(3, 0, 0)


def test_a_cut_sample_counts_the_labels_of_the_prefix_it_keeps():
    """max_tokens 8, a sample of 20 tokens whose first 10 are a prompt: the 8 tokens kept hold no
    label. Counted from the labels when the feed gives them; from sizes alone only where every
    position is a label or none is; otherwise a refusal naming what to give."""
    labels = [-100] * 10 + [5] * 10
    model = CostModel(max_tokens=8)
    sample, outcome = model.measure(0, 20, 10, 0, labels)
    assert (sample.tokens, sample.label_tokens, outcome) == (8, 0, "truncated")
    labels = [-100] * 3 + [5] * 2 + [-100] * 2 + [5] * 13  # two turns: positions 3, 4 and 7 kept
    assert model.measure(0, 20, count_label_tokens(labels), 0, labels)[0].label_tokens == 3
    assert model.measure(0, 20, 19)[0].label_tokens == 7 and model.measure(0, 20, 0)[0].label_tokens == 0
    with pytest.raises(OverCapError, match="10 label tokens.*the Feed's 4th element"):
        model.measure(0, 20, 10)
    with pytest.raises(ValueError, match="19 labels for 20 tokens"):
        model.measure(0, 20, 10, 0, labels[:19])
    admitted, outcomes = model.measure_many([0, 1], [(20, 10, 0, [-100] * 10 + [5] * 10), (5, 4, 0, [1] * 5)])
    assert [(s.tokens, s.label_tokens) for s in admitted] == [(8, 0), (5, 4)] and outcomes["truncated"] == 1


@pytest.mark.parametrize("coefs", [{}, {"attn_coef": 0.25}, {"patch_coef": 0.5}],
                         ids=["linear-fast-path", "attention-term", "patch-term"])
@pytest.mark.parametrize("over_cap", ["truncate", "drop", "sequence_parallel"])
def test_measure_many_matches_measure(coefs, over_cap):
    # Without cost coefficients measure_many takes a fast path for samples within the caps: it
    # must agree with measure() on those (patches, label tokens, costs) and on every edge around
    # them (at the cap, over it, over the patch cap, no labels, skipped records).
    model = CostModel(max_tokens=8, max_patches=6, over_cap=over_cap, degrees=(2,), **coefs)
    raw = [(3, 2, 0), (9, 8, 0), (8, 0, 0), None, (1, 0, 6), (5, 5, 7), (8, 7, 2), (2, 1, 3), (17, 16, 0)]
    admitted, outcomes = model.measure_many(list(range(len(raw))), raw)
    measured = [model.measure(i, *r) for i, r in enumerate(raw) if r is not None]
    assert admitted == [sample for sample, _ in measured if sample is not None]
    assert outcomes == {"truncated": sum(o == "truncated" for _, o in measured),
                        "truncated_tokens": sum(r[0] - model.long_cap for r, (_, o) in
                                                zip([r for r in raw if r], measured) if o == "truncated"),
                        "dropped": sum(o == "dropped" for _, o in measured), "skipped": 1,
                        "long": sum(o == "long" for _, o in measured)}
    assert outcomes["truncated" if over_cap != "drop" else "dropped"] >= 1
    assert outcomes["long"] == (over_cap == "sequence_parallel")  # (9 tokens: a group of 2 holds it whole)


def test_a_long_sample_costs_each_rank_of_its_group_its_share_and_the_all_to_all():
    """over_cap 'sequence_parallel' at max_tokens 100 with groups of 2 and 4: the smallest group that
    holds a sample at 100 a rank; its cost, the whole sample's with the all-to-all term, over the
    group's ranks; over the largest group's 400 it is cut to 400, counted."""
    model = CostModel(max_tokens=100, over_cap="sequence_parallel", degrees=(4, 2), attn_coef=0.01, a2a_coef=0.5)
    assert [model.degree(n) for n in (100, 101, 200, 201, 400, 401)] == [1, 2, 2, 4, 4, 4]
    assert model.cost(100) == round(100 + 0.01 * 100 ** 2)
    assert model.cost(300) == round((300 + 0.01 * 300 ** 2 + 0.5 * 300) / 4)
    sample, outcome = model.measure(7, 300, 250)
    assert (sample.tokens, sample.label_tokens, sample.cost, outcome) == (300, 250, model.cost(300), "long")
    sample, outcome = model.measure(7, 450, 449)
    assert (sample.tokens, sample.label_tokens, outcome) == (400, 399, "truncated")
    # a resume on fewer ranks (groups of 2 at most): a held sample of 300 is cut to 200
    fewer = CostModel(max_tokens=100, over_cap="sequence_parallel", degrees=(2,))
    again = fewer.reprice(model.measure(7, 300, 250)[0])
    assert (again.tokens, again.label_tokens, again.cost) == (200, 199, fewer.cost(200))
    # without groups (one rank) over_cap 'sequence_parallel' truncates at max_tokens
    assert CostModel(max_tokens=100, over_cap="sequence_parallel").measure(1, 150, 149)[0].tokens == 100


@pytest.mark.parametrize(("max_sp", "world", "degrees"), [(8, 1, ()), (8, 2, (2,)), (8, 4, (2, 4)), (2, 8, (2,)),
                                                          (8, 6, (2,)), (8, 16, (2, 4, 8)), (1, 4, ())])
def test_groups_for_long_samples_are_the_powers_of_two_up_to_max_sp_that_divide_the_ranks(max_sp, world, degrees):
    assert sequence_parallel_degrees(max_sp, world) == degrees


@pytest.mark.parametrize("bad", [{"policy": "fixed"}, {"mode": "quota", "quota": 5}, {"pad_rows": True}])
def test_over_cap_sequence_parallel_refuses_what_cannot_split_a_packed_row(bad):
    with pytest.raises(ValueError, match="--over_cap sequence_parallel splits a long sample's packed row"):
        OdbConfig(over_cap="sequence_parallel", **bad)


def test_label_tokens_skip_first_position_and_ignored():
    assert count_label_tokens([5, 6, -100, 7]) == 2
    assert count_label_tokens([-100, -100]) == 0
