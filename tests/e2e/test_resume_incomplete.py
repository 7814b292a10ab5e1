"""--resume auto past a real DeepSpeed save cut short: a job killed while writing its second
checkpoint leaves that tag with a rank's optimizer file half written, and no 'latest' naming a
tag (a killed first save leaves none at all). The next job resumes from the newest complete tag,
moving the cut one aside. The oracle: the steps trained again from that checkpoint have the losses
the first job had at them. The same decision over each backend's file set, in one process:
tests/unit/test_cli_output_dir.py and tests/unit/test_checkpoint_files.py."""

from __future__ import annotations

import json
from pathlib import Path

from checkpoint_tags import deepspeed_files
from launch import deepspeed, ds_config, odb_config
from odb.training.run.checkpoint import missing_parts

WORLD, SAVES = 2, 2  # checkpoints every 2 steps; the first job stops after 4


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def test_resume_auto_resumes_from_the_newest_complete_deepspeed_checkpoint(tmp_path):
    out = tmp_path / "run"
    flags = ["--deepspeed_config", str(ds_config(tmp_path, 2)),
             "--odb_config", str(odb_config(tmp_path, max_tokens=256, window=16, gas=2)),
             "--max_samples", "48", "--output_dir", str(out), "--no_final_checkpoint"]
    deepspeed([*flags, "--max_steps", str(2 * SAVES), "--save_steps", str(SAVES)], nproc=WORLD)
    checkpoints = out / "checkpoints"
    first = losses(out)
    assert (checkpoints / "latest").read_text() == f"step{2 * SAVES}" and [s for s, _ in first] == [0, 1, 2, 3]
    for tag in (f"step{SAVES}", f"step{2 * SAVES}"):  # what a real save writes: the file set the unit tests use
        assert sorted(p.name for p in (checkpoints / tag).glob("*.pt")) == sorted(deepspeed_files(world=WORLD, stage=2))
        assert missing_parts(checkpoints / tag) == []

    # killed while rank 1 wrote its optimizer file of step4: half of it there, 'latest' not yet moved
    # on (here: gone, as after a killed first save)
    cut = checkpoints / f"step{2 * SAVES}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    half = cut.read_bytes()
    (checkpoints / "latest").unlink()
    proc = deepspeed([*flags, "--resume", "auto"], nproc=WORLD)

    aside = out / "incomplete_checkpoints" / f"step{2 * SAVES}"
    assert (f"odb: --resume auto: {checkpoints} has no 'latest' (a save that did not finish): resuming from "
            f"step{SAVES}, the newest complete checkpoint; moved the incomplete step{2 * SAVES} "
            f"(zero_pp_rank_1_mp_rank_00_optim_states.pt cut short) to {aside}") in proc.stdout
    assert f"resumed from {checkpoints / f'step{SAVES}'}" in proc.stdout
    assert (aside / cut.name).read_bytes() == half  # (moved whole, not deleted)
    rows = losses(out)  # (the first run's rows from step SAVES on moved to metrics.superseded.jsonl)
    assert [s for s, _ in rows] == list(range(len(rows))) and rows[:SAVES] == first[:SAVES]
    resumed = rows[SAVES:]
    assert resumed[0][0] == SAVES and len(resumed) > SAVES
    assert [s for s, _ in resumed[:SAVES]] == [s for s, _ in first[SAVES:]]
    for (step, loss), (_, before) in zip(resumed[:SAVES], first[SAVES:], strict=True):  # (rows keep 6 decimals)
        assert abs(loss - before) <= 2e-6, (step, loss, before)
    assert json.loads((out / "summary.json").read_text())["steps"] == resumed[-1][0] + 1
