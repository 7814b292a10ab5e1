import json

import pytest

from odb.batching.config import OdbConfig, load_odb_config
from odb.batching.cost import CostModel, OverCapError, count_label_tokens


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


@pytest.mark.parametrize("coefs", [{}, {"attn_coef": 0.25}, {"patch_coef": 0.5}],
                         ids=["linear-fast-path", "attention-term", "patch-term"])
@pytest.mark.parametrize("over_cap", ["truncate", "drop"])
def test_measure_many_matches_measure(coefs, over_cap):
    # Without cost coefficients measure_many takes a fast path for samples within the caps: it
    # must agree with measure() on those (patches, label tokens, costs) and on every edge around
    # them (at the cap, over it, over the patch cap, no labels, skipped records).
    model = CostModel(max_tokens=8, max_patches=6, over_cap=over_cap, **coefs)
    raw = [(3, 2, 0), (9, 8, 0), (8, 0, 0), None, (1, 0, 6), (5, 5, 7), (8, 7, 2), (2, 1, 3)]
    admitted, outcomes = model.measure_many(list(range(len(raw))), raw)
    measured = [model.measure(i, *r) for i, r in enumerate(raw) if r is not None]
    assert admitted == [sample for sample, _ in measured if sample is not None]
    assert outcomes == {"truncated": sum(o == "truncated" for _, o in measured),
                        "truncated_tokens": sum(r[0] - 8 for r, (_, o) in zip([r for r in raw if r], measured)
                                                if o == "truncated"),
                        "dropped": sum(o == "dropped" for _, o in measured), "skipped": 1}
    assert outcomes["truncated" if over_cap == "truncate" else "dropped"] >= 1


def test_label_tokens_skip_first_position_and_ignored():
    assert count_label_tokens([5, 6, -100, 7]) == 2
    assert count_label_tokens([-100, -100]) == 0
