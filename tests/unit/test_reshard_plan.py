"""odb.training.reshard's decisions, on stand-in checkpoint files (only the entries it reads).

The conversion and the loads themselves run for real in tests/e2e/test_reshard.py.
"""

import json

import pytest
import torch

from odb.training.backends.universal import (
    UNIVERSAL,
    plan_load,
    saved_world_size,
    saved_zero_stage,
    to_universal,
    universal_folder,
    with_universal_load,
)


def fake_checkpoint(folder, tag, *, stage: int, world_size: int) -> None:
    """The rank-0 model-states file DeepSpeed writes (per rank at ZeRO-3), with what reshard reads."""
    (folder / tag).mkdir(parents=True)
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(4)}, "dp_world_size": world_size,
                "ds_config": {"zero_optimization": {"stage": stage}}}, folder / tag / name)


def ds_config(stage: int) -> dict:
    return {"train_batch_size": 6, "zero_optimization": {"stage": stage}, "checkpoint": {"tag_validation": "Warn"}}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_saving_world_size_and_stage_are_read_from_deepspeeds_files(tmp_path, stage):
    fake_checkpoint(tmp_path, "step4", stage=stage, world_size=3)
    assert saved_world_size(tmp_path, "step4") == 3
    assert saved_zero_stage(tmp_path, "step4") == stage


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="step9"):
        plan_load(tmp_path, "step9", world_size=2, ds_config=ds_config(2))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_1_to_3_on_another_world_size_loads_the_universal_conversion(tmp_path, stage):
    fake_checkpoint(tmp_path, "step4", stage=stage, world_size=2)
    config = ds_config(stage)
    plan = plan_load(tmp_path, "step4", world_size=3, ds_config=config)
    assert plan.is_universal and (plan.folder, plan.tag) == (tmp_path / "step4", UNIVERSAL)
    assert plan.folder / plan.tag == universal_folder(tmp_path, "step4")
    assert plan.ds_config["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}
    assert config == ds_config(stage)  # the caller's config is not changed


@pytest.mark.parametrize(("stage", "saved_by"), [(0, 2), (2, 3), (3, 3)])
def test_zero_0_or_the_same_world_size_loads_the_checkpoint_as_it_is(tmp_path, stage, saved_by):
    fake_checkpoint(tmp_path, "step4", stage=stage, world_size=saved_by)
    plan = plan_load(tmp_path, "step4", world_size=3, ds_config=ds_config(stage))
    assert not plan.is_universal and (plan.folder, plan.tag) == (tmp_path, "step4")
    assert plan.ds_config == ds_config(stage)


def test_another_zero_stage_is_refused_naming_the_saved_one(tmp_path):
    fake_checkpoint(tmp_path, "step4", stage=2, world_size=2)
    with pytest.raises(ValueError, match="saved at ZeRO-2.*ZeRO-3.*ZeRO-2 DeepSpeed config"):
        plan_load(tmp_path, "step4", world_size=2, ds_config=ds_config(3))


def test_a_zero_0_checkpoint_is_not_converted(tmp_path):
    fake_checkpoint(tmp_path, "step4", stage=0, world_size=2)
    with pytest.raises(ValueError, match="ZeRO-0 checkpoint.*loads at any world size"):
        to_universal(tmp_path, "step4")
    assert not universal_folder(tmp_path, "step4").exists()


def test_a_finished_conversion_is_not_redone(tmp_path):
    fake_checkpoint(tmp_path, "step4", stage=2, world_size=2)
    done = universal_folder(tmp_path, "step4") / "zero" / "optimizer_state.pt"
    done.parent.mkdir(parents=True)
    done.write_bytes(b"")  # a converter run here would fail on the stand-in files
    assert to_universal(tmp_path, "step4") == universal_folder(tmp_path, "step4")


def test_a_universal_load_at_zero_0_is_refused():
    with pytest.raises(ValueError, match="ZeRO-0.*as it is"):
        with_universal_load({"zero_optimization": {"stage": 0}})


def test_with_universal_load_copies():
    config = {"zero_optimization": {"stage": 2}}
    out = with_universal_load(config)
    assert out == {"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}
    assert config == {"zero_optimization": {"stage": 2}} and json.dumps(out)
