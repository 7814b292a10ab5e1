"""The training run behind ``launch/train.py``: init -> build -> train -> close."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from odb.align import TorchCommunicator
from odb.batcher import OnlineBatcher
from odb.cli import TrainArgs
from odb.data import SampleDataset, sample_cost
from odb.engine import BLANK_IMAGE_TOKENS, OdbEngine
from odb.feed import SampleFeed
from odb.metrics import StepTimes, Telemetry
from odb.model import build_model, load_tokenizer, vision_spec
from odb.vision import supports_packing
from odb.schedule import ProgressSchedule

__all__ = ["Trainer"]


def _single_process_env() -> None:
    """``python launch/train.py`` without a launcher: one rank on this machine."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


class Trainer:
    """One rank of a run. Every rank calls the same methods in the same order."""

    def __init__(self, targs: TrainArgs) -> None:
        self.targs, self.args, self.config = targs, targs.args, targs.odb
        self.output_dir = Path(self.args.output_dir)

    # ---- init -------------------------------------------------------------------------------

    @classmethod
    def init(cls, targs: TrainArgs) -> "Trainer":
        import deepspeed
        import torch.distributed as dist

        _single_process_env()
        if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
            # CPU ranks share the machine's cores instead of each taking all of them
            local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        deepspeed.init_distributed(timeout=timedelta(seconds=targs.args.dist_timeout_s))
        trainer = cls(targs)
        trainer.rank, trainer.world_size = dist.get_rank(), dist.get_world_size()
        trainer.output_dir.mkdir(parents=True, exist_ok=True)
        return trainer

    # ---- build ------------------------------------------------------------------------------

    def build(self) -> "Trainer":
        import deepspeed

        args = self.args
        self.tokenizer = load_tokenizer(args.tokenizer)
        model = build_model(args.model, seed=args.seed, vocab_size=len(self.tokenizer), lora=self.targs.lora)
        if vision_spec(model, self.targs.data) is not None:
            # a micro-batch without images carries a 3-token blank image (odb/engine.py): keep room
            self.config = dataclasses.replace(self.config, max_tokens=self.config.max_tokens - BLANK_IMAGE_TOKENS)
            self.log(f"odb: vision model: samples packed under max_tokens - {BLANK_IMAGE_TOKENS} "
                     f"= {self.config.max_tokens} (room for the blank image of imageless micro-batches)")
        config = self.config
        truncate_to = config.max_tokens if config.over_cap == "truncate" else None
        self.dataset = SampleDataset(args.data, self.tokenizer, self.targs.data, seed=args.seed,
                                     max_samples=args.max_samples, truncate_to=truncate_to,
                                     vision=vision_spec(model, self.targs.data))
        packed = supports_packing(model)
        if not packed:
            self.log(f"odb: cannot pack {model.config.model_type} correctly (its rotary positions are "
                     "unknown to odb): training on PADDED micro-batches instead")
        ds_config = dict(self.targs.ds_config)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = None
        if "optimizer" not in ds_config:  # a torch optimizer: no DeepSpeed op to compile
            optimizer = (torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
                         if args.optimizer == "adamw" else torch.optim.SGD(params, lr=args.lr))
            if args.optimizer == "sgd":
                ds_config.setdefault("zero_allow_untested_optimizer", True)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                          config=ds_config)
        self.engine = OdbEngine(engine, world_size=self.world_size, max_tokens=config.max_tokens,
                                pad_token_id=self.tokenizer.pad_token_id, packed=packed)
        self.feed = SampleFeed(self.dataset, sample_cost, num_workers=args.num_workers,
                               prefetch_factor=args.prefetch_factor)
        self.comm = TorchCommunicator(timeout_s=args.dist_timeout_s)
        self.batcher = OnlineBatcher(config, self.comm, dataset_size=len(self.dataset), fetch=self.feed.fetch,
                                     num_epochs=args.epochs, on_deal=self.feed.deal, on_drop=self.feed.forget)
        planned = config.quota if config.mode == "quota" else args.epochs * len(self.dataset)
        self.planned = planned
        self.schedule = ProgressSchedule(args.lr, planned, warmup_ratio=args.warmup_ratio)
        effective = self._effective_config(ds_config, packed)
        self.wandb_run = self._wandb(effective) if args.report_to == "wandb" and self.rank == 0 else None
        self.samples_done = self.steps_done = 0  # over the whole run, resumes included
        self.losses: list[float] = []  # this rank's loss per token, per step
        self.totals = {"micro_batches": 0, "dummy_micro_batches": 0, "samples": 0, "real_tokens": 0,
                       "materialized_tokens": 0, "steps": 0}
        self.saved: str | None = None  # the last checkpoint tag written
        if args.resume:
            self._resume(args.resume)
        self.telemetry = Telemetry(
            rank=self.rank, max_steps_per_round=self.batcher.capacity // config.gas + 1,
            max_tokens=config.max_tokens, dataset_size=len(self.dataset), samples_done=self.samples_done,
            output_dir=self.output_dir,
            sink=(lambda row: self.wandb_run.log(row, step=row["step"])) if self.wandb_run else None)
        self.batcher.report = lambda: self.telemetry.report(self.feed.skipped)
        self.batcher.on_reports = self.telemetry.on_reports
        self.log("odb: " + ", ".join(f"{k} {v}" for k, v in effective.items()))
        return self

    def _effective_config(self, ds_config: dict, packed: bool) -> dict:
        config, args = self.config, self.args
        if not packed:
            attention = "padded (sdpa)"
        elif torch.cuda.is_available():
            attention = "odb_varlen: flash-attn varlen" if _has_flash_attn() else "odb_varlen: torch varlen_attn"
        else:
            attention = "odb_varlen: SDPA per group of similar-length samples (CPU)"
        return {"world_size": self.world_size, "max_tokens": config.max_tokens, "window": config.window,
                "gas": config.gas, "mode": config.mode, "policy": config.policy,
                "zero_stage": ds_config.get("zero_optimization", {}).get("stage", 0),
                "bf16": ds_config.get("bf16", {}).get("enabled", False), "attention": attention,
                "model": args.model, "lora": bool(self.targs.lora), "data": args.data,
                "dataset_samples": len(self.dataset), "epochs": args.epochs, "planned_samples": self.planned,
                "lr": args.lr, "num_workers": args.num_workers}

    def _wandb(self, effective: dict):
        import wandb  # only when asked for

        tags = [t for t in self.args.wandb_tags.split(",") if t]
        return wandb.init(project=self.args.wandb_project, name=self.args.run_name or self.output_dir.name,
                          tags=tags, dir=str(self.output_dir),
                          config={**effective, "odb": self.config.to_dict(), "deepspeed": self.targs.ds_config})

    # ---- train ------------------------------------------------------------------------------

    def train(self) -> "Trainer":
        args, batcher = self.args, self.batcher
        audit = open(self.output_dir / f"emitted_ids.rank{self.rank}.jsonl", "a") if args.audit_ids else None
        progress = self._progress_bar()
        start = time.perf_counter()
        steps_this_run = 0
        plans = iter(batcher)
        while True:
            began = time.perf_counter()
            spent = (batcher.fetch_s, batcher.plan_s, batcher.aligner.collective_s)
            plan = next(plans, None)  # a round may run here: fetching, planning, one collective
            if plan is None:
                break
            samples = [[self.feed.take(uid) for uid in micro.uids] for micro in plan.micro_batches]
            result = self.engine.train_step(plan, samples, self.schedule(self.samples_done))
            self.samples_done += plan.num_samples
            self.steps_done = plan.step + 1
            self._count(plan)
            times = StepTimes(wait=batcher.fetch_s - spent[0], plan=batcher.plan_s - spent[1],
                              collective=batcher.aligner.collective_s - spent[2], step=time.perf_counter() - began,
                              ended=time.time())
            self.telemetry.record(plan, loss_sum=result.loss_sum, lr=result.lr,
                                  materialized=sum(m.materialized for m in plan.micro_batches), times=times)
            if audit:
                size = len(self.dataset)
                for m, micro in enumerate(plan.micro_batches):
                    audit.write(json.dumps({"epoch": plan.epoch, "step": plan.step, "micro": m,
                                            "ids": [u % size for u in micro.uids]}) + "\n")
            steps_this_run += 1
            self.losses.append(result.loss_sum / max(1, result.label_tokens))
            if progress is not None:
                progress.update(plan.num_samples)
                last = self.telemetry.last
                if last:
                    progress.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                         pad=f"{last['padding_ratio']:.2f}", refresh=False)
            if args.save_steps and self.steps_done % args.save_steps == 0:
                self.save(f"step{self.steps_done}")
            if args.max_steps and steps_this_run >= args.max_steps:
                break
        self.wall_s = time.perf_counter() - start
        if progress is not None:
            progress.close()
        if audit:
            audit.close()
        return self

    def _progress_bar(self):
        if self.rank != 0:
            return None
        from tqdm import tqdm

        return tqdm(total=self.planned, initial=self.samples_done, unit="sample", desc="odb", disable=None,
                    dynamic_ncols=True)

    def _count(self, plan) -> None:
        t = self.totals
        t["steps"] += 1
        for micro in plan.micro_batches:
            t["micro_batches"] += not micro.is_dummy
            t["dummy_micro_batches"] += micro.is_dummy
            t["samples"] += len(micro.samples)
            t["real_tokens"] += micro.tokens
            t["materialized_tokens"] += micro.materialized

    # ---- checkpoints ------------------------------------------------------------------------

    def save(self, tag: str) -> None:
        folder = self.output_dir / "checkpoints"
        self.engine.engine.save_checkpoint(str(folder), tag=tag, client_state={
            "samples_done": self.samples_done, "steps_done": self.steps_done})
        state = self.batcher.state_dict()
        (folder / tag / f"odb_state.rank{self.rank}.json").write_text(json.dumps(state))
        self.saved = tag

    def _resume(self, tag: str) -> None:
        folder = self.output_dir / "checkpoints"
        tag = (folder / "latest").read_text().strip() if tag == "latest" else tag
        path, client = self.engine.engine.load_checkpoint(str(folder), tag=tag)
        if path is None:
            raise FileNotFoundError(f"--resume: no DeepSpeed checkpoint {folder / tag}")
        state = json.loads((folder / tag / f"odb_state.rank{self.rank}.json").read_text())
        self.feed.sampler.queue.clear()  # the fresh batcher's first deal is replaced by the state's
        self.batcher.load_state_dict(state)
        self.feed.restore(self.batcher.held_uids())
        self.samples_done, self.steps_done = client["samples_done"], client["steps_done"]
        self.log(f"resumed from {folder / tag}: {self.samples_done} samples done")

    # ---- close ------------------------------------------------------------------------------

    def close(self) -> dict:
        import torch.distributed as dist

        if not self.args.no_final_checkpoint and self.saved != f"step{self.steps_done}":
            self.save(f"step{self.steps_done}")
        keys = sorted(self.totals)
        counts = self.batcher.counts
        own = [self.totals[k] for k in keys] + [counts["truncated"], counts["dropped"]]
        tsize = self.telemetry.size
        gathered = self.batcher.aligner.gather_reports(
            np.concatenate([self.telemetry.report(self.feed.skipped), np.asarray(own, dtype=np.int64)]))
        self.telemetry.on_reports(gathered[:, :tsize])  # completes the last round's steps
        summed = dict(zip(keys + ["truncated", "dropped"], gathered[:, tsize:].sum(axis=0).tolist()))
        if self.feed.examples:
            print(f"rank {self.rank} skipped records, e.g.: " + "; ".join(self.feed.examples), flush=True)
        summary = {
            "world_size": self.world_size, "dataset_samples": len(self.dataset), "epochs": self.args.epochs,
            "steps": self.totals["steps"], "micro_batches": summed["micro_batches"],
            "dummy_micro_batches": summed["dummy_micro_batches"], "samples_emitted": summed["samples"],
            "real_tokens": summed["real_tokens"], "materialized_tokens": summed["materialized_tokens"],
            "padding_ratio": round(1 - summed["real_tokens"] / max(1, summed["materialized_tokens"]), 6),
            "truncated": summed["truncated"], "dropped": summed["dropped"], "skipped": self.telemetry.skipped,
            "loss_first": round(sum(self.losses[:3]) / max(1, len(self.losses[:3])), 5),
            "loss_last": round(sum(self.losses[-3:]) / max(1, len(self.losses[-3:])), 5),
            "wall_s": round(self.wall_s, 3),
            "samples_per_s": round(summed["samples"] / max(1e-9, self.wall_s), 3),
            "tokens_per_s": round(summed["real_tokens"] / max(1e-9, self.wall_s), 1),
            "policy": self.config.policy, "rounds": self.batcher.round_index,
            "odb_collectives": self.comm.num_collectives,  # start check + one per round + this close
        }
        if self.rank == 0:
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.log(f"done: {json.dumps(summary)}")
            if self.wandb_run is not None:
                self.wandb_run.summary.update(summary)
                self.wandb_run.finish()
        self.telemetry.close()
        self.feed.close()
        dist.barrier()
        dist.destroy_process_group()
        return summary

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
