"""The start-up check (torch, the backend's APIs, the packed attention path) and the announced waits
(odb/training/run/startup.py), in one process. tests/e2e/test_startup_launch.py launches them for real."""

import os
import re
import threading
import time

import pytest
import torch

from conftest import train_defaults
from launch import ROOT
from odb.training.attention.cuda import attention_path
from odb.training.launch.flags import parse_config
from odb.training.run.startup import (
    TORCH_FLOOR,
    StartupError,
    check_restarts,
    check_startup,
    check_torch,
    probed_attention,
    torch_version,
)
from odb.training.run.waits import WAIT_REPORT_ENV, announced_wait
from odb.training.run.watchdog import EXIT_STALLED

DEFAULTS = train_defaults()


def test_setup_py_states_the_floor_the_start_up_check_enforces():
    text = (ROOT / "setup.py").read_text()
    floors = re.findall(r'"torch>=(\d+)\.(\d+)[^"]*"', text)
    assert floors == [tuple(map(str, TORCH_FLOOR))], floors  # one floor, a range (no pin)
    assert "torch==" not in text and "torch<" not in text
    assert torch_version() >= TORCH_FLOOR  # (this install)
    assert torch_version("2.6.0+cu124") == (2, 6) and torch_version("2.10.0a0+git1234") == (2, 10)


def test_an_older_torch_is_refused_naming_the_release_to_install(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    with pytest.raises(StartupError, match=r"odb needs torch >= 2\.6 .*found 2\.5\.1\+cu121: "
                                           r"pip install 'torch>=2\.6'"):
        check_torch("deepspeed")


def test_fsdp2_on_a_torch_without_its_apis_is_refused_naming_the_fix(monkeypatch):
    import torch.distributed.fsdp as fsdp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    check_torch("fsdp2")  # this torch has them all
    monkeypatch.delattr(fsdp, "fully_shard")
    monkeypatch.delattr(StateDictOptions, "broadcast_from_rank0")
    monkeypatch.delitem(StateDictOptions.__dataclass_fields__, "broadcast_from_rank0")
    with pytest.raises(StartupError, match=r"--backend fsdp2 needs torch\.distributed\.fsdp\.fully_shard, "
                                           r".*StateDictOptions\.broadcast_from_rank0, which torch .* lacks: "
                                           r"pip install 'torch>=2\.6', or train with --backend deepspeed"):
        check_torch("fsdp2")
    check_torch("deepspeed")  # DeepSpeed does not use them


def test_the_banner_names_the_path_the_probe_found(tmp_path):
    for flags, dtype in (([], torch.float32), (["--backend", "fsdp2"], torch.float32)):
        config = parse_config([*flags, "--output_dir", str(tmp_path / "out")], defaults=DEFAULTS)
        expected = "odb_varlen: " + attention_path(torch.device("cpu"), dtype)
        assert check_startup(config) == probed_attention(config) == expected


def test_a_path_that_cannot_run_stops_the_rank_naming_the_fix(monkeypatch, tmp_path):
    """What attention_path raises (on CUDA: e.g. a flash-attn that fails to import) reaches the rank as a
    StartupError that keeps the fix."""
    from odb.training import attention
    from odb.training.run import startup

    def broken(device, dtype):
        raise RuntimeError("flash-attn 2.8.3 is installed but fails to import (undefined symbol): install the "
                           "flash-attn build for torch 2.11, or `pip uninstall flash-attn`")

    monkeypatch.setattr(attention, "attention_path", broken)
    startup._attention_path.cache_clear()
    try:
        with pytest.raises(StartupError, match=r"packed attention cannot run on cpu in float32: flash-attn .*"
                                               r"`pip uninstall flash-attn`"):
            check_startup(parse_config(["--output_dir", str(tmp_path / "out")], defaults=DEFAULTS))
    finally:
        startup._attention_path.cache_clear()


def test_a_model_that_mixes_tokens_outside_attention_is_refused_before_any_process_group(tmp_path):
    """A hybrid LFM2 (short convolutions) as a config JSON: refused at start naming its layers; the same
    family with attention layers only passes (the check reads the config's own layers)."""
    import json

    layers = {"model_type": "lfm2", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    hybrid, attention_only = tmp_path / "hybrid.json", tmp_path / "attention.json"
    hybrid.write_text(json.dumps({**layers, "layer_types": ["conv", "full_attention"]}))
    attention_only.write_text(json.dumps({**layers, "layer_types": ["full_attention", "full_attention"]}))
    with pytest.raises(StartupError, match=r"odb cannot pack lfm2: its layers \['Lfm2ShortConv'\] mix tokens"):
        check_startup(parse_config(["--model", str(hybrid), "--output_dir", str(tmp_path / "a")], defaults=DEFAULTS))
    check_startup(parse_config(["--model", str(attention_only), "--output_dir", str(tmp_path / "b")],
                               defaults=DEFAULTS))


def test_torchrun_restarts_over_several_nodes_are_refused_naming_the_way_out():
    """Each node's agent counts its own restarts: the ranks of a restarted attempt would disagree on
    the attempt's store keys. One node, or no restarts, passes."""
    several = {"TORCHELASTIC_MAX_RESTARTS": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(StartupError, match=r"--max-restarts 3 over several nodes \(16 ranks, 8 here\).*"
                                           r"--max-restarts 0 and let the scheduler requeue"):
        check_restarts(several)
    check_restarts({**several, "LOCAL_WORLD_SIZE": "16"})
    check_restarts({**several, "TORCHELASTIC_MAX_RESTARTS": "0"})
    check_restarts({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})  # the deepspeed launcher, srun


def test_a_sequence_parallel_size_that_cannot_run_is_refused_before_the_weights_load(tmp_path):
    """The tiny model has 4 attention heads and 2 KV heads; the tiny VL model is a vision model."""
    from odb.training.model.capability import skeleton
    from odb.training.run.startup import check_sequence_parallel

    def check(size: int, world: int, model: str = "tiny_model.json") -> None:
        path = ROOT / "configs" / model
        config = parse_config(["--model", str(path), "--sequence_parallel_size", str(size), "--output_dir",
                               str(tmp_path / "out")], defaults=DEFAULTS)
        check_sequence_parallel(config, skeleton(path), {"WORLD_SIZE": str(world)})

    check(2, 4)
    check(4, 8)  # 4 heads over 4 ranks, the 2 KV heads replicated
    with pytest.raises(StartupError, match=r"--sequence_parallel_size 2 must divide the 3 ranks of this launch"):
        check(2, 3)
    with pytest.raises(StartupError, match=r"sequence_parallel_size 8 must divide the model's 4 attention heads"):
        check(8, 8)
    with pytest.raises(StartupError, match=r"is a vision model.*sequence_parallel_size 1"):
        check(2, 2, "tiny_vl_model.json")


def test_long_sample_groups_that_cannot_run_are_refused_before_the_weights_load(tmp_path):
    """over_cap 'sequence_parallel' forms groups of 2, 4, ... up to max_sp that divide the ranks:
    on 16 ranks with max_sp 8 a group of 8 would split the tiny model's 4 heads."""
    from odb.training.model.capability import skeleton
    from odb.training.run.startup import check_sequence_parallel

    def check(max_sp: int, world: int, model: str = "tiny_model.json", *more: str) -> None:
        path = ROOT / "configs" / model
        config = parse_config(["--model", str(path), "--over_cap", "sequence_parallel", "--max_sp", str(max_sp),
                               "--output_dir", str(tmp_path / "out"), *more], defaults=DEFAULTS)
        check_sequence_parallel(config, skeleton(path), {"WORLD_SIZE": str(world)})

    check(8, 4)  # groups of 2 and 4
    check(4, 16)
    check(8, 1)  # (one rank: no group; the build warns that long samples are truncated)
    with pytest.raises(StartupError, match=r"--max_sp 8 on 16 ranks forms groups of 2, 4, 8 ranks: "
                                           r"sequence_parallel_size 8 must divide the model's 4 attention heads"):
        check(8, 16)
    with pytest.raises(StartupError, match=r"is a vision model.*a lower --max_sp, or --over_cap truncate"):
        check(8, 2, "tiny_vl_model.json")
    with pytest.raises(StartupError, match=r"--sequence_parallel_size splits every row: use one of them"):
        check(2, 4, "tiny_model.json", "--sequence_parallel_size", "2")


def test_a_wait_is_reported_while_it_lasts_and_not_after(monkeypatch, capsys):
    monkeypatch.setenv(WAIT_REPORT_ENV, "0.2")
    monkeypatch.setenv("RANK", "3")
    with announced_wait("the model to load from X", "check the storage", timeout_s=60):
        time.sleep(0.9)
    time.sleep(0.5)  # the thread has stopped: nothing more
    lines = capsys.readouterr().err.splitlines()
    assert 3 <= len(lines) <= 5, lines
    assert all(re.fullmatch(r"odb: rank 3: waiting \d s for the model to load from X; check the storage", x)
               for x in lines), lines


def test_a_wait_on_a_datasets_cache_lock_names_the_lock_and_its_holder(monkeypatch, tmp_path, capsys):
    """Hugging Face datasets converts a Parquet file into its cache under a filelock lock while every
    other rank waits on it: the report names that lock and the process holding it (here this one,
    through another descriptor), not only 'the data to be indexed'."""
    from datasets.utils._filelock import FileLock

    monkeypatch.setenv(WAIT_REPORT_ENV, "0.2")
    lock = tmp_path / "parquet" / "default-0_builder.lock"
    lock.parent.mkdir()
    held = threading.Event()

    def hold() -> None:  # another thread's descriptor (filelock refuses a second lock in one thread)
        with FileLock(str(lock)):
            held.set()
            time.sleep(1.0)

    threading.Thread(target=hold).start()
    held.wait()
    with announced_wait("the data x.parquet to be indexed", "check the storage", timeout_s=60):
        with FileLock(str(lock)):  # what datasets' builder does before it converts the file
            pass
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(f"for the lock {lock}, held by pid {os.getpid()} (" in line for line in lines[1:]), lines


def test_the_interval_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv(WAIT_REPORT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{WAIT_REPORT_ENV}='soon': set it to a number of seconds"):
        with announced_wait("x", "y", timeout_s=1):
            pass


def test_a_stale_extension_lock_is_named_and_ends_the_wait_after_the_timeout(monkeypatch, tmp_path, capsys):
    """A real lock file, as a killed build leaves it, and torch's own FileBaton waiting on it: the
    report names the file; after ``timeout_s`` with nothing changing in its folder the rank is ended
    (here: ``exit`` records the code and deletes the lock, which ends torch's wait)."""
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv(WAIT_REPORT_ENV, "0.5")
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    lock = folder / "lock"
    lock.write_text("")
    codes: list[int] = []

    def exit(code: int) -> None:
        codes.append(code)
        lock.unlink()

    began = time.monotonic()
    with announced_wait("DeepSpeed's op", "check", timeout_s=2, exit=exit):
        FileBaton(str(lock)).wait()
    waited = time.monotonic() - began
    err = capsys.readouterr().err
    assert codes == [EXIT_STALLED] and waited >= 2, (codes, waited)  # not before timeout_s (after: the load)
    assert re.search(rf"odb: rank 0: waiting \d s for DeepSpeed's op: for the lock {lock} of torch's C\+\+ "
                     "extension build", err), err
    assert f"{lock} has been there for 2 s with no build running" in err and f"Delete it (rm {lock})" in err


def test_a_lock_held_by_a_live_build_is_waited_for(monkeypatch, tmp_path, capsys):
    """A build that writes in its folder (ninja's objects) keeps the wait going past ``timeout_s``."""
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv(WAIT_REPORT_ENV, "0.5")
    folder = tmp_path / "op"
    folder.mkdir()
    lock = folder / "lock"
    lock.write_text("")
    stop = threading.Event()

    def build() -> None:  # a build that takes 3 s, writing an object file each 0.5 s, then releases
        for i in range(6):
            (folder / f"part{i}.o").write_text("")
            stop.wait(0.5)
        lock.unlink()

    builder = threading.Thread(target=build)
    builder.start()
    codes: list[int] = []
    with announced_wait("the op", "check", timeout_s=1, exit=codes.append):
        FileBaton(str(lock)).wait()
    builder.join()
    assert codes == [] and "has been there" not in capsys.readouterr().err
