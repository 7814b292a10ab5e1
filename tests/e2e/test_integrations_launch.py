"""odb inside HF Trainer, TRL's SFTTrainer and DPOTrainer and an Accelerate loop (odb.integrations,
the examples): the oracle is odb's own trainer (launch/train.py) on the same model, data, seed and
settings.

Stated tolerance: per-step losses within 1e-5 (relative), final weights within 1e-5 (absolute).
What was measured (2 CPU ranks, 100 bundled samples): HF Trainer at ZeRO-2 7.6e-7 from odb's own
ZeRO-2, at ZeRO-3 with GAS 2 (and a resume) 0.0; the Accelerate loop (DDP) 7.5e-9 from odb's
ZeRO-0. Only the optimizer's floating-point order differs: the loss of every micro-batch is odb's
(odb.training.step.objective.NextTokenTally) in both."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file

from launch import ROOT, audit, deepspeed, ds_config, free_port, launch_env, launches, odb_config
from odb.batching.stream import epoch_order

HF = ROOT / "examples" / "hf_trainer.py"
ACCELERATE = ROOT / "examples" / "accelerate_loop.py"
SAMPLES = 100


@launches
def torchrun(script: Path, args: list[str], *, nproc: int = 2, timeout: int = 420) -> subprocess.CompletedProcess:
    """``script`` under torchrun, as a user starts it; it must succeed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=launch_env(PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def own(tmp_path, stage: int, *, gas: int = 1) -> Path:
    """odb's own trainer: the oracle."""
    out = tmp_path / f"odb{stage}"
    deepspeed(["--deepspeed_config", str(ds_config(tmp_path, stage)), "--odb_config", str(odb_config(tmp_path)),
               "--gas", str(gas), "--max_samples", str(SAMPLES), "--output_dir", str(out), "--audit_ids",
               "--save_hf", "--no_final_checkpoint"])
    return out


def host_args(tmp_path, out: Path, *extra: str) -> list[str]:
    return ["--odb_config", str(odb_config(tmp_path)), "--max_samples", str(SAMPLES), "--output_dir", str(out),
            "--audit_ids", *extra]


def losses(out: Path) -> list[float]:
    """The steps' losses (not a per-source interval's own row: odb.telemetry.sources)."""
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [row["loss"] for row in rows if "loss" in row]


def check_same_run(host: Path, reference: Path, *, samples: int | None = SAMPLES) -> None:
    """The host's run trained what odb's own did: the same micro-batches on every rank (aligned,
    every one of ``samples`` records once), the same losses, the same final weights, the same
    summary counts."""
    rows = audit(host, 2)
    assert rows == audit(reference, 2)
    shapes = [[(r["step"], r["micro"]) for r in rank] for rank in rows]
    assert shapes[0] == shapes[1]
    if samples is not None:
        assert Counter(i for rank in rows for r in rank for i in r["ids"]) == Counter(range(samples))
    assert losses(host) == pytest.approx(losses(reference), rel=1e-5)
    mine, theirs = load_file(host / "hf" / "model.safetensors"), load_file(reference / "hf" / "model.safetensors")
    assert set(theirs) <= set(mine)
    diffs = {name: float((mine[name].float() - weight.float()).abs().max()) for name, weight in theirs.items()}
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses(host), losses(reference), strict=True))
    print(f"{host.name} against {reference.name}: {len(losses(host))} steps, losses within {loss_diff:.1e} "
          f"(relative), weights within {max(diffs.values()):.1e}")
    assert max(diffs.values()) <= 1e-5, diffs
    summary, expected = (json.loads((o / "summary.json").read_text()) for o in (host, reference))
    for key in ("steps", "micro_batches", "dummy_micro_batches", "samples_emitted", "real_tokens", "label_tokens"):
        assert summary[key] == expected[key], key


def test_hf_trainer_and_trl_at_zero2_train_what_odbs_own_trainer_does(tmp_path):
    reference = own(tmp_path, 2)
    deepspeed_config = str(ds_config(tmp_path, 2))
    for name, extra in (("hf", []), ("trl", ["--trl"])):
        out = tmp_path / name
        deepspeed(host_args(tmp_path, out, "--deepspeed", deepspeed_config, *extra), script=HF)
        check_same_run(out, reference)


def test_trl_dpo_at_zero2_trains_what_odbs_own_dpo_does(tmp_path):
    """with_odb(DPOTrainer), a full fine-tune whose ref_model is the initial model (odb's reference
    'model': its forward per micro-batch, packed), against odb's own --objective dpo (reference
    precompute: the initial weights' log-probs, one pass before the first step): the same math, so
    the same micro-batches, losses and final weights, 2 ranks at ZeRO-2 over the 40 bundled pairs."""
    pairs = ["--data", str(ROOT / "data" / "preference.jsonl"), "--max_samples", "40"]
    stage = str(ds_config(tmp_path, 2))
    reference = tmp_path / "odb"
    deepspeed(["--deepspeed_config", stage, "--odb_config", str(odb_config(tmp_path)), "--objective", "dpo",
               "--beta", "0.1", *pairs, "--output_dir", str(reference), "--audit_ids", "--save_hf",
               "--no_final_checkpoint"])
    out = tmp_path / "trl"
    deepspeed(["--odb_config", str(odb_config(tmp_path)), *pairs, "--output_dir", str(out), "--audit_ids",
               "--deepspeed", stage, "--dpo", "--beta", "0.1"], script=HF)
    check_same_run(out, reference, samples=40)


def test_a_weighted_mixture_under_hf_trainer_ends_with_its_data_within_odbs_step_bound(tmp_path):
    """Two sources, weights 0.8 / 0.2, mix_epoch all: the larger one is up-sampled to its share,
    which odb measures as it goes. The host (HF Trainer, ZeRO-2) plans with odb's step bound (twice
    a probe's estimate of the epoch), stops when the data ends, below the bound, and trains what
    odb's own trainer trains on the same mixture (the shares' exactness: tests/sim/test_mixture.py);
    an Accelerate loop (DDP) trains the same micro-batches to the data's end."""
    chat = (ROOT / "data" / "chat.jsonl").read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(chat[:40]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(chat[40:60]) + "\n")
    data = ["--data", f"a={tmp_path / 'a.jsonl'}:0.8", f"b={tmp_path / 'b.jsonl'}:0.2"]
    zero2 = str(ds_config(tmp_path, 2))
    reference = tmp_path / "odb"
    deepspeed(["--deepspeed_config", zero2, "--odb_config", str(odb_config(tmp_path)), *data, "--output_dir",
               str(reference), "--audit_ids", "--save_hf", "--no_final_checkpoint"])
    out = tmp_path / "hf"
    run = deepspeed(["--odb_config", str(odb_config(tmp_path)), *data, "--output_dir", str(out), "--audit_ids",
                     "--deepspeed", zero2], script=HF)
    check_same_run(out, reference, samples=None)
    bound = int(run.stdout.split("the host's step bound: ")[1].split(",")[0])
    summary = json.loads((out / "summary.json").read_text())
    sources = {name: figures["samples"] for name, figures in summary["sources"].items()}
    print(f"HF Trainer, a weighted mixture: {summary['steps']} steps within odb's bound of {bound}; "
          f"samples per source {sources}, shares {({n: f['share'] for n, f in summary['sources'].items()})}")
    assert summary["steps"] < bound and "WARNING" not in run.stdout
    assert sources["a"] > 60 and sources["b"] >= 20  # a up-sampled past its one pass (of 40), b whole
    for name, figures in summary["sources"].items():
        assert abs(figures["share"] - {"a": 0.8, "b": 0.2}[name]) < 0.05, summary["sources"]
    loop = tmp_path / "accelerate"  # an Accelerate loop needs no step count: it runs until the steps end
    torchrun(ACCELERATE, ["--odb_config", str(odb_config(tmp_path)), *data, "--output_dir", str(loop), "--audit_ids"])
    assert audit(loop, 2) == audit(reference, 2)


def test_hf_trainer_at_zero3_resumes_odbs_position_from_its_own_checkpoint(tmp_path):
    reference = own(tmp_path, 3, gas=2)
    out = tmp_path / "hf"
    common = host_args(tmp_path, out, "--deepspeed", str(ds_config(tmp_path, 3)), "--gas", "2", "--save_steps", "1")
    deepspeed([*common, "--max_steps", "1"], script=HF)
    first = audit(out, 2)
    assert [len(rank) for rank in first] == [2, 2]  # one step of GAS 2, then the run stopped
    assert sorted(p.name for p in (out / "checkpoint-1").glob("*_state.rank*.json")) == [
        "odb_state.rank0.json", "odb_state.rank1.json", "run_state.rank0.json", "run_state.rank1.json"]
    resumed = deepspeed([*common, "--resume"], script=HF)
    assert "odb: resumed from" in resumed.stdout
    check_same_run(out, reference)  # the audit files hold both parts: together, the uninterrupted run's


def test_accelerate_loop_under_torchrun_trains_what_odbs_own_trainer_does(tmp_path):
    reference = own(tmp_path, 0)
    out = tmp_path / "accelerate"
    torchrun(ACCELERATE, host_args(tmp_path, out))
    check_same_run(out, reference)


def test_a_rank_with_far_fewer_samples_does_not_hang_the_host_loop(tmp_path):
    """Static shards: every record of rank 1's shard is over the budget and dropped, so rank 1
    trains nothing; it still runs every step (dummies), and the run ends."""
    short = {"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}]}
    long = {"messages": [{"role": "user", "content": "Count."},
                         {"role": "assistant", "content": " ".join(["one two three"] * 200)}]}
    rank1 = set(epoch_order(0, 0, 40)[1::2].tolist())  # rank 1's static shard (seed 0, epoch 0)
    data = tmp_path / "uneven.jsonl"
    data.write_text("".join(json.dumps(long if i in rank1 else short) + "\n" for i in range(40)))
    out = tmp_path / "uneven"
    config = odb_config(tmp_path, max_tokens=256, window=8, gas=2, sharding="static", over_cap="drop")
    deepspeed(["--data", str(data), "--odb_config", str(config), "--output_dir", str(out), "--audit_ids"],
              script=ACCELERATE, timeout=300)
    rows = audit(out, 2)
    shapes = [[(r["step"], r["micro"]) for r in rank] for rank in rows]
    assert shapes[0] == shapes[1] and len(shapes[0]) >= 2
    assert not [i for r in rows[1] for i in r["ids"]]  # rank 1: dummies only
    assert Counter(i for r in rows[0] for i in r["ids"]) == Counter(set(range(40)) - rank1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped"] == 20 and summary["samples_emitted"] == 20
