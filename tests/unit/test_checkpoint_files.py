"""A checkpoint that is truncated, incomplete, foreign or of another odb version gives an error
that says what is wrong and what to do (odb.training.run.checkpoint), never a KeyError from inside;
and what marks a tag complete (missing_parts), which --resume auto reads where no 'latest' names one."""

import json
import shutil
from types import SimpleNamespace

import pytest

from checkpoint_tags import write_deepspeed_files, write_fsdp2_files, write_odb_files, write_tag
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import SimulatedFeed, run_ranks
from odb.telemetry import Telemetry
from odb.training.run.checkpoint import checkpoint_states, missing_parts, resolve_tag, sorted_tags


def saved(tmp_path, world=2):
    """A checkpoint folder with real batcher and run states of ``world`` ranks."""
    samples = [(5 + i % 7, 0) for i in range(40)]
    config = OdbConfig(max_tokens=32, window=8)

    def rank_state(comm):
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=SimulatedFeed(samples))
        next(iter(batcher))
        return batcher.state_dict()

    tag = tmp_path / "checkpoints" / "step1"
    tag.mkdir(parents=True)
    for r, state in enumerate(run_ranks(world, rank_state)):
        (tag / f"odb_state.rank{r}.json").write_text(json.dumps(state))
        telemetry = Telemetry(rank=1, max_steps_per_round=4, max_tokens=32, dataset_size=40, output_dir=tmp_path)
        (tag / f"run_state.rank{r}.json").write_text(json.dumps(telemetry.state_dict({}, {})))
    (tmp_path / "checkpoints" / "latest").write_text("step1")
    return tag


def test_a_good_checkpoint_loads_on_its_world_size_and_on_another(tmp_path):
    tag = saved(tmp_path)
    state, run_state, world = checkpoint_states(tag, rank=1, world_size=2)
    assert (state["rank"], world) == (1, 2)
    state, run_state, world = checkpoint_states(tag, rank=2, world_size=3)
    assert (state["rank"], state["world_size"], world) == (2, 3, 2)


def test_truncated_missing_foreign_and_other_version_files_name_the_file_and_the_fix(tmp_path):
    tag = saved(tmp_path)
    good = (tag / "odb_state.rank1.json").read_text()
    (tag / "odb_state.rank1.json").write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"odb_state.rank1.json is truncated or not JSON .*--resume TAG"):
        checkpoint_states(tag, rank=1, world_size=2)
    with pytest.raises(ValueError, match="truncated or not JSON"):  # another world size reads every rank's
        checkpoint_states(tag, rank=0, world_size=3)
    (tag / "odb_state.rank1.json").unlink()
    with pytest.raises(FileNotFoundError, match="odb_state.rank1.json is missing: the checkpoint was not written"):
        checkpoint_states(tag, rank=1, world_size=2)
    (tag / "odb_state.rank1.json").write_text(json.dumps({"weights": [1, 2]}))
    with pytest.raises(ValueError, match="is not an odb batcher state"):
        checkpoint_states(tag, rank=1, world_size=2)
    (tag / "odb_state.rank1.json").write_text(json.dumps({**json.loads(good), "version": 99}))
    with pytest.raises(ValueError, match="disagree on 'version': not one run's checkpoint"):
        checkpoint_states(tag, rank=0, world_size=3)
    for r in range(2):
        path = tag / f"odb_state.rank{r}.json"
        path.write_text(json.dumps({**json.loads(good), "rank": r, "version": 99}))
    with pytest.raises(ValueError, match="version 99 cannot be re-dealt by this odb"):
        checkpoint_states(tag, rank=0, world_size=3)


def test_resume_tags_that_do_not_exist_name_the_tags_there_are(tmp_path):
    saved(tmp_path)
    config = SimpleNamespace(output_dir=tmp_path)
    assert resolve_tag(config, "latest") == "step1"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint .*step9; the tags there are \['step1'\]"):
        resolve_tag(config, "step9")
    (tmp_path / "checkpoints" / "latest").unlink()
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        resolve_tag(config, "latest")


@pytest.mark.parametrize("saved_by,resumed_by", [("deepspeed", "fsdp2"), ("fsdp2", "deepspeed")])
def test_a_checkpoint_resumes_only_under_the_backend_that_saved_it(tmp_path, saved_by, resumed_by):
    from odb.training.config.optimization import Fsdp2Settings, OptimizationSettings
    from odb.training.config.settings import DataSettings, ModelSettings, RunConfig, RunSettings
    from odb.training.run.checkpoint import load_plan

    tag = saved(tmp_path)
    (tag / "run_config.json").write_text(json.dumps({"optimization": {"backend": saved_by}}))
    optimization = OptimizationSettings(backend=resumed_by, fsdp2=Fsdp2Settings() if resumed_by == "fsdp2" else None)
    config = RunConfig(model=ModelSettings(path="m", tokenizer="t"), data=DataSettings(path="d"), batching=OdbConfig(),
                       optimization=optimization, run=RunSettings(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=f"saved by --backend {saved_by}, this run is --backend {resumed_by}; "
                                         f"resume it with --backend {saved_by}"):
        load_plan(config, "step1", rank=0, world_size=2)


# ---- what marks a tag complete --------------------------------------------------------------------

LAYOUTS = {"deepspeed-zero0": ("deepspeed", 0, False), "deepspeed-zero2": ("deepspeed", 2, False),
           "deepspeed-zero2-bf16": ("deepspeed", 2, True), "deepspeed-zero3": ("deepspeed", 3, False),
           "fsdp2": ("fsdp2", None, False)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tag_is_complete_only_with_every_file_a_killed_save_may_lack_there_whole(tmp_path, layout):
    """A save killed part-way leaves its tag without some files, or with one cut short. The oracle
    is the file set itself: each file a killed save may not have finished, removed or cut to half
    its bytes, is named. Those are odb's JSON files (3 ranks: the world size odb_state.rank0.json
    names), every DeepSpeed file, and FSDP2's DCP .metadata, which DCP renames into place once every
    rank's shards are written (a shard without it is not whole either)."""
    backend, stage, bf16 = LAYOUTS[layout]
    tag = tmp_path / "checkpoints" / "step4"
    write_odb_files(tag, world=3, backend=backend)
    odb_files = sorted(p.name for p in tag.iterdir())
    assert len(odb_files) == 7  # run_config.json and 2 per rank
    if backend == "fsdp2":
        backend_files, cut = write_fsdp2_files(tag), []  # (.metadata appears at once whole, or not at all)
        assert "fsdp2/.metadata" in backend_files
        backend_files = ["fsdp2/.metadata"]
    else:
        backend_files = cut = write_deepspeed_files(tag, world=3, stage=stage, bf16=bf16)
    assert missing_parts(tag) == []
    for name in [*odb_files, *backend_files, *(f"cut:{name}" for name in [*odb_files, *cut])]:
        case = shutil.copytree(tag, tmp_path / "cases" / name.replace("/", "_") / "step4")
        path = case / name.removeprefix("cut:")
        if name.startswith("cut:"):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            path.unlink()
        gaps = missing_parts(case)
        what = "cut short" if name.startswith("cut:") else "missing"
        # (a rank-0 file cut short hides what it would name: the other ranks' files)
        assert len(gaps) == 1 and name.removeprefix("cut:") in gaps[0] and what in gaps[0], (name, gaps)


def test_tags_are_sorted_by_their_step_the_incomplete_ones_apart(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (2, 10, 12, 9):
        write_tag(folder, f"step{step}", backend="fsdp2", world=2)
    (folder / "step12" / "fsdp2" / ".metadata").unlink()
    (folder / "step9" / "run_state.rank1.json").unlink()
    (folder / "latest").write_text("step10")  # (a file: no tag)
    complete, incomplete = sorted_tags(folder)
    assert complete == ["step2", "step10"]
    assert incomplete == {"step9": ["run_state.rank1.json missing"], "step12": ["fsdp2/.metadata missing"]}
    assert sorted_tags(tmp_path / "none") == ([], {})
