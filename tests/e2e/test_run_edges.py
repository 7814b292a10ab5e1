"""The run's edges: LoRA on a vision model, the LR plan with lost records, resuming a finished
run, whole-run summaries, global losses, and quota-mode epochs. Each one a bug a review found."""

import json
import math
import shutil
from collections import Counter

from launch import ROOT, audit, deepspeed, deepspeed_watched, ds_config, odb_config
from odb.batching.state import is_finished, upgrade_state


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out):
    return json.loads((out / "summary.json").read_text())


def chats(tmp_path, num_chats, num_without_answer=0):
    """The first ``num_chats`` bundled chats, then records with no assistant turn (skipped)."""
    lines = (ROOT / "data" / "chat.jsonl").read_text().splitlines()[:num_chats]
    lines += [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})
              for i in range(num_without_answer)]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity are not JSON (Python's json writes them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_skipped_records_leave_the_learning_rate_plan_and_an_eval_set_without_labels_gives_null(tmp_path):
    """60 chats + 20 records without an answer: the schedule plans 60 samples, not 80, so the
    last step's LR is the cosine at (samples before it) / 60, near the 0.1 x floor. Every eval
    record without an assistant turn: there is no eval loss. It was written as a bare NaN into
    metrics.jsonl and summary.json, which JSON readers refuse. (Two bugs, one launch.)"""
    out, lr, evals = tmp_path / "out", 1e-3, tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                             for i in range(4)))
    proc = deepspeed(["--data", str(chats(tmp_path, 60, 20)), "--deepspeed_config", str(ds_config(tmp_path, 2)),
                      "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)), "--lr", str(lr),
                      "--warmup_ratio", "0", "--eval_data", str(evals), "--output_dir", str(out),
                      "--no_final_checkpoint"])
    rows = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = summary(out)["samples_emitted"]
    assert trained == 60 and summary(out)["skipped"] == {"no_assistant_turn": 20}
    last = [r for r in rows if "loss" in r][-1]
    progress = (last["samples_done"] - last["samples"]) / trained
    expected = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert abs(last["lr"] - expected) <= 1e-9 * lr, (last["lr"], expected)

    [row] = [r for r in rows if "eval_loss" in r]
    assert row["eval_loss"] is None and row["eval_label_tokens"] == 0
    assert strict_json((out / "summary.json").read_text())["eval_loss"] is None
    assert "no loss (eval_loss null: no sample has a label token" in proc.stdout, proc.stdout[-2000:]


def test_resume_with_more_epochs_extends_a_finished_run_and_without_them_refuses(tmp_path):
    out = tmp_path / "out"
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "40", "--audit_ids",
              "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)), "--output_dir", str(out)]
    deepspeed(common)
    first = summary(out)
    (out / "emitted_ids.rank0.jsonl").rename(out / "first.rank0.jsonl")
    (out / "emitted_ids.rank1.jsonl").rename(out / "first.rank1.jsonl")
    deepspeed(common + ["--resume", "--epochs", "2"])
    rows = [r for rank in audit(out, 2) for r in rank]
    assert {r["epoch"] for r in rows} == {1}
    assert Counter(i for r in rows for i in r["ids"]) == Counter(range(40))  # epoch 1, exactly once
    second = summary(out)
    assert second["samples_emitted"] == 80 and second["steps"] > first["steps"] > 0
    try:
        deepspeed(common + ["--resume", "--epochs", "2"], timeout=180)
    except AssertionError as err:
        assert "already trained all 2 epoch(s) and finished; pass --epochs > 2" in str(err)
    else:
        raise AssertionError("a resume of a finished run with no more epochs must fail, not train 0 steps")
    assert summary(out) == second  # and it leaves the summary alone


def test_a_checkpoint_of_every_step_whose_run_did_not_finish_resumes_into_the_end(tmp_path):
    """A stop on SIGTERM at a run's last step saves that step and exits 75 before the end of the run
    (evaluation, export, summary); a failure in the end (an export that crashes) leaves the same.
    Its checkpoint holds every step, and --resume refused it as "already trained": the requeued job
    failed for ever, the run never got its evaluation, export or summary. Here the state such a stop
    leaves is made from a finished run (its last checkpoint without the mark of a finished run, no
    summary); --resume finishes the run and marks it finished (so a further --resume is refused)."""
    out = tmp_path / "out"
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "40", "--val_ratio", "0.2",
              "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=16)), "--output_dir", str(out)]
    deepspeed(common, nproc=1)
    first = summary(out)
    last = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / last / "finished").is_file()
    (out / "checkpoints" / last / "finished").unlink()
    (out / "summary.json").unlink()
    log = deepspeed(common + ["--resume"], nproc=1).stdout
    assert "every step is trained: finishing the run" in log, log[-3000:]
    second = summary(out)
    assert second["steps"] == first["steps"] and second["samples_emitted"] == first["samples_emitted"] == 32
    assert second["eval_loss"] == first["eval_loss"]  # the same weights, evaluated at the end again
    # what makes a further --resume refuse (odb/training/run/checkpoint.py; the refusal is launched in the
    # test above): the latest checkpoint, saved again by this resume, is marked finished and its
    # batcher state has every step planned and trained
    tag = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    state = upgrade_state(json.loads((tag / "odb_state.rank0.json").read_text()))
    assert (tag / "finished").is_file() and is_finished(state) and state["epoch"] >= 1


def test_quota_mode_labels_each_sample_with_its_own_epoch(tmp_path):
    """40 samples, quota 60: the stream runs into a second pass over the data."""
    out = tmp_path / "out"
    deepspeed(["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "40", "--audit_ids",
               "--odb_config", str(odb_config(tmp_path, max_tokens=512, window=8, mode="quota", quota=60)),
               "--output_dir", str(out), "--no_final_checkpoint"])
    rows = [r for rank in audit(out, 2) for r in rank]
    labels = [(i, e) for r in rows for i, e in zip(r["ids"], r.get("epochs", [r["epoch"]] * len(r["ids"])))]
    assert len(labels) == 60 and max(Counter(labels).values()) == 1  # no sample twice in one epoch
    assert {i for i, _ in labels} <= set(range(40)) and max(e for _, e in labels) >= 1
    steps = metrics(out)
    assert max(s["epoch"] for s in steps) >= 1
    assert summary(out)["epochs"] == 1.5



def losses_by_step(out):
    return {row["step"]: row["loss"] for row in metrics(out) if "loss" in row}


def test_every_checkpoint_of_the_last_round_resumes_on_the_same_ranks_as_the_uninterrupted_run(tmp_path):
    """The last round plans several steps at once; a checkpoint between them (``--save_steps``, a
    preemption) said "done" and could not be resumed. Every step of a 2-rank run is checkpointed;
    each checkpoint of the last round but the final one is resumed in a folder of its own: the same
    micro-batches (audit ids) and losses as the uninterrupted run, from the step after it on."""
    full = tmp_path / "full"
    common = ["--deepspeed_config", str(ds_config(tmp_path, 2)), "--max_samples", "60", "--audit_ids",
              "--odb_config", str(odb_config(tmp_path, max_tokens=384, window=12))]  # 11 steps, the last round 3
    deepspeed(common + ["--output_dir", str(full), "--save_steps", "1"])
    reference, reference_losses = audit(full, 2), losses_by_step(full)
    total = summary(full)["steps"]
    states = {k: json.loads((full / "checkpoints" / f"step{k}" / "odb_state.rank0.json").read_text())
              for k in range(1, total + 1)}
    last_round = [k for k, state in states.items() if state["is_planned"] and state["queue"]]
    print(f"{total} steps; checkpoints inside the last round: {last_round}")
    assert last_round, "the case needs a last round of several steps"
    assert not states[total]["queue"]
    for k in last_round:
        out = tmp_path / f"from{k}"
        shutil.copytree(full / "checkpoints" / f"step{k}", out / "checkpoints" / f"step{k}")
        proc = deepspeed(common + ["--output_dir", str(out), "--resume", f"step{k}"])
        assert f"resumed from {out / 'checkpoints' / f'step{k}'}" in proc.stdout
        resumed = audit(out, 2)
        for rank in range(2):
            assert resumed[rank] == [row for row in reference[rank] if row["step"] >= k], (k, rank)
        after = losses_by_step(out)
        assert sorted(after) == list(range(k, total))
        for step, loss in after.items():  # metrics rows keep 6 decimals
            assert abs(loss - reference_losses[step]) <= 2e-6, (k, step, loss, reference_losses[step])
        assert summary(out)["samples_emitted"] == 60 and summary(out)["steps"] == total


def test_a_fresh_run_in_a_folder_with_checkpoints_stops_every_rank_before_any_process_group(tmp_path):
    """A fresh run in a folder that holds checkpoints retrained from step 0 there, overwriting them
    and appending a second run to metrics.jsonl. Every rank refuses while parsing its flags."""
    out = tmp_path / "out"
    (out / "checkpoints" / "step3").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step3")
    code, output, _ = deepspeed_watched(["--deepspeed_config", str(ds_config(tmp_path, 2)), "--output_dir", str(out)],
                                        nproc=2, timeout=180)
    assert code != 0
    assert output.count(f"--output_dir {out} holds an earlier run (checkpoints): pass --resume to continue it, "
                        "--overwrite_output_dir to start over") == 2, output[-3000:]
    assert "init_distributed" not in output and (out / "checkpoints" / "latest").read_text() == "step3"
