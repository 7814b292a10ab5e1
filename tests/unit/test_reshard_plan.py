"""odb's universal-checkpoint decisions that need no checkpoint. Those that read DeepSpeed's files
run on the checkpoints DeepSpeed itself writes, in tests/e2e/test_reshard.py."""

import json

import pytest

from odb.training.backends.universal import plan_load, with_universal_load


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="step9"):
        plan_load(tmp_path, "step9", world_size=2, ds_config={"zero_optimization": {"stage": 2}})


def test_a_universal_load_at_zero_0_is_refused():
    with pytest.raises(ValueError, match="ZeRO-0.*as it is"):
        with_universal_load({"zero_optimization": {"stage": 0}})


def test_with_universal_load_copies():
    config = {"zero_optimization": {"stage": 2}}
    out = with_universal_load(config)
    assert out == {"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}
    assert config == {"zero_optimization": {"stage": 2}} and json.dumps(out)
