"""One rank of tests/e2e/test_reshard.py, one process per rank (tests/launch.py, or by hand under torchrun).

Usage: torchrun --nproc_per_node W tests/e2e/reshard_worker.py ROOT JOB [JOB ...]

Each JOB is ``PHASE:STAGE:MODEL:PRECISION`` (``save:2:full:fp32``, ``load:2:lora:bf16``, ...),
run in turn, each with an engine of its own, and works in ``ROOT/<case>/`` where case is
``z<STAGE>-<MODEL>-<PRECISION>``: the tiny model (configs/tiny_model.json; MODEL ``full``, or
``lora`` with configs/lora.json) under configs/ds_zero<STAGE>.json, resolved as odb resolves it
(GAS 1, this launch's world size, PRECISION ``fp32`` or ``bf16``), with odb's AdamW
(:func:`odb.training.backends.deepspeed.initialize_deepspeed`, lr 1e-3, weight decay 0.01).

* ``save``: trains 2 optimizer steps, dumps the full state to ``saved.pt``, saves DeepSpeed's
  checkpoint as ``ckpt/step2``, trains a third step and dumps ``saved_step3.pt``: the
  uninterrupted run.
* ``load``: loads ``ckpt/step2`` the way odb resumes (:func:`odb.training.backends.universal.prepare_load`:
  rank 0 converts where the world size changed, the engine is built from the plan's config),
  dumps ``loaded.pt``, trains the third step and dumps ``loaded_step3.pt``.
* ``plain``: loads ``ckpt/step2`` as it is, without a conversion, and writes what that raised
  (or null) to ``plain.json``: DeepSpeed's own answer to a changed world size.
* ``unconvertible``: :func:`odb.training.backends.universal.prepare_load` on a checkpoint that cannot be
  converted; writes what each rank raised (or null) to ``unconvertible.json``.

The batches of a step are the same at every world size: 6 fixed random rows of 24 tokens, rank r
taking rows r, r + W, ...; each rank backs ``summed token loss * W / N`` (N: the step's scored
tokens over all rows), so DeepSpeed's average over the W ranks is the step's mean token loss
whatever W is. A dump holds, per parameter (by name), the full fp32 weight and, for a trained
one, Adam's full ``exp_avg`` and ``exp_avg_sq`` (gathered: ``safe_get_full_*`` at ZeRO-1/2/3; at
ZeRO-0 in bf16 the fp32 master weight that DeepSpeed's optimizer keeps for it), and the
optimizer's steps, hyperparameters and DeepSpeed's ``global_steps``; rank 0 writes it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's odb, installed or not

from odb.training.backends.deepspeed import build_model, initialize_deepspeed, release  # noqa: E402
from odb.training.backends.deepspeed_config import load_ds_config, resolve_ds_config  # noqa: E402
from odb.training.backends.universal import prepare_load  # noqa: E402
from odb.training.config.optimization import OptimizationSettings  # noqa: E402
from odb.training.model.build import load_tokenizer  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.loss import token_loss_sum  # noqa: E402

TAG = "step2"
ROWS, TOKENS = 6, 24  # rows divide among 2 and 3 ranks


def case_name(stage: int, model_kind: str, precision: str) -> str:
    return f"z{stage}-{model_kind}-{precision}"


def resolved_ds_config(stage: int, precision: str, world: int) -> dict:
    return resolve_ds_config(load_ds_config(ROOT / "configs" / f"ds_zero{stage}.json"), gas=1, world_size=world,
                             use_bf16=precision == "bf16")


def build_engine(model_kind: str, ds_config: dict):
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    lora = json.loads((ROOT / "configs" / "lora.json").read_text()) if model_kind == "lora" else None
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=len(tokenizer), lora=lora,
                        ds_config=ds_config)
    opt = OptimizationSettings(lr=1e-3, weight_decay=0.01, deepspeed=ds_config)
    return initialize_deepspeed(opt, model), len(tokenizer)


def train_step(engine, step: int, *, rank: int, world: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(3, vocab, (ROWS, TOKENS), generator=gen)
    mine = rows[rank::world]
    positions = torch.arange(TOKENS).expand_as(mine)  # each row one sample
    logits = engine(input_ids=mine, position_ids=positions, use_cache=False).logits
    loss = token_loss_sum(logits, mine) * world / (ROWS * (TOKENS - 1))
    engine.backward(loss)
    engine.step()


def full_state(engine, stage: int) -> dict:
    """The whole state, gathered (collective: every rank, in the same order); rank 0's to keep."""
    params, moments = {}, {}
    optimizer = engine.optimizer
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2 link each weight to its Adam moments at the first step() only:
        link()  # after a load at the saving world size, before any step, safe_get_full_optimizer_state fails
    masters = {}  # ZeRO-0 in bf16: DeepSpeed's fp32 master copy of each trained weight, whole on every rank
    for lows, highs in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", [])):
        masters.update({id(low): high for low, high in zip(lows, highs, strict=True)})
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            if stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    params[name] = p.detach().float().clone()
            else:
                params[name] = p.detach().float().clone()
        elif stage == 0:
            high = masters.get(id(p), p)
            state = getattr(optimizer, "optimizer", optimizer).state[high]
            params[name] = high.detach().float().clone()
            moments[name] = {key: state[key].clone() for key in ("exp_avg", "exp_avg_sq")}
        else:
            params[name] = safe_get_full_fp32_param(p).clone()
            moments[name] = {key: safe_get_full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")}
    base = getattr(optimizer, "optimizer", optimizer)  # ZeRO and bf16 wrap the torch optimizer
    steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    return {"params": params, "moments": moments, "steps": steps, "groups": groups,
            "global_steps": engine.global_steps}


def run_job(job: str, root: Path, *, rank: int, world: int) -> dict:
    """One job; returns the files rank 0 writes into the case's folder (name -> value)."""
    phase, stage, model_kind, precision = job.split(":")
    stage = int(stage)
    ckpt = root / case_name(stage, model_kind, precision) / "ckpt"
    ds_config = resolved_ds_config(stage, precision, world)
    if phase == "save":
        engine, vocab = build_engine(model_kind, ds_config)
        for step in range(2):
            train_step(engine, step, rank=rank, world=world, vocab=vocab)
        saved = full_state(engine, stage)
        engine.save_checkpoint(str(ckpt), tag=TAG)
        train_step(engine, 2, rank=rank, world=world, vocab=vocab)
        files = {"saved.pt": saved, "saved_step3.pt": full_state(engine, stage)}
    elif phase == "load":
        plan = prepare_load(ckpt, TAG, rank=rank, world_size=world, ds_config=ds_config)
        engine, vocab = build_engine(model_kind, plan.ds_config)
        path, _ = engine.load_checkpoint(str(plan.folder), tag=plan.tag)
        assert path is not None, f"nothing loaded from {plan.folder / plan.tag}"
        loaded = full_state(engine, stage)
        loaded["is_universal"] = plan.is_universal
        train_step(engine, 2, rank=rank, world=world, vocab=vocab)
        files = {"loaded.pt": loaded, "loaded_step3.pt": full_state(engine, stage)}
    elif phase == "plain":
        engine, _ = build_engine(model_kind, ds_config)
        try:
            path, _ = engine.load_checkpoint(str(ckpt), tag=TAG)
            error = None if path is not None else "nothing loaded"
        except Exception as exc:  # noqa: BLE001 - what DeepSpeed raised is the result
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            error = f"{type(exc).__name__}: {exc} ({Path(frame.filename).name}:{frame.lineno})"
        files = {"plain.json": {"error": error}}
    elif phase == "unconvertible":
        try:
            prepare_load(ckpt, TAG, rank=rank, world_size=world, ds_config=ds_config, timeout_s=120)
            error = None
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            error = f"{type(exc).__name__}: {exc}"
        errors = [None] * world
        dist.all_gather_object(errors, error)
        return {"unconvertible.json": {"errors": errors}}
    else:
        raise SystemExit(f"unknown phase in job {job!r}")
    engine.destroy()
    return files


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # (DeepSpeed's runner adds --local_rank)
    root, jobs = Path(args[0]), args[1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    deepspeed.init_distributed(timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    try:
        for job in jobs:
            files = run_job(job, root, rank=rank, world=world)
            if rank == 0:
                folder = root / case_name(*(int(x) if x.isdigit() else x for x in job.split(":")[1:]))
                for name, value in files.items():
                    if name.endswith(".json"):
                        (folder / name).write_text(json.dumps(value))
                    else:
                        torch.save(value, folder / name)
            gc.collect()
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
