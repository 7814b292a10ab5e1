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

from odb.batching.align import TorchCommunicator
from odb.batching.batcher import OnlineBatcher
from odb.training.cli import TrainArgs
from odb.data.processing import SampleDataset, sample_cost
from odb.training.engine import BLANK_IMAGE_TOKENS, OdbEngine
from odb.data.feed import SampleFeed
from odb.telemetry import StepTimes, Telemetry
from odb.training.model import build_model, load_tokenizer, vision_spec
from odb.training.mrope import supports_packing
from odb.training.schedule import ProgressSchedule, planned_to_train

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
            # a micro-batch without images carries a 3-token blank image (odb/training/engine.py): keep room
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
                     "unknown to odb): training on PADDED micro-batches instead, each within "
                     f"rows x longest <= {config.max_tokens} tokens")
            if config.policy == "odb":
                self.config = config = dataclasses.replace(config, pad_rows=True)
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
        # This rank's counts over the whole run (restored on resume); summed over ranks at the end.
        self.totals = {"micro_batches": 0, "dummy_micro_batches": 0, "samples": 0, "real_tokens": 0,
                       "materialized_tokens": 0, "steps": 0, "wall_us": 0}
        self.this_process = {"steps": 0, "samples": 0, "rounds_before": 0}
        self.first_losses: list[float] = []  # the run's first global step losses (kept on resume)
        self.fetched_lost = [0, 0]  # run-wide records processed and lost, as of the last round
        self.wall_s = 0.0
        self._started: float | None = None  # while the train loop runs
        self.saved: str | None = None  # the last checkpoint tag written
        if args.resume:
            self._resume(args.resume)
        self.telemetry = Telemetry(
            rank=self.rank, max_steps_per_round=self.batcher.capacity // config.gas + 1,
            max_tokens=config.max_tokens, dataset_size=len(self.dataset), samples_done=self.samples_done,
            output_dir=self.output_dir,
            sink=(lambda row: self.wandb_run.log(row, step=row["step"])) if self.wandb_run else None)
        self.telemetry.fetched, self.telemetry.lost = self.fetched_lost  # the LR plan, as it stood
        self.batcher.report = self._report
        self.batcher.on_reports = self.telemetry.on_reports
        self.log("odb: " + ", ".join(f"{k} {v}" for k, v in effective.items()))
        return self

    def _effective_config(self, ds_config: dict, packed: bool) -> dict:
        config, args = self.config, self.args
        if not packed:
            attention = "padded (sdpa)"
        elif torch.cuda.is_available():
            attention = ("odb_varlen: flash-attn varlen" if _has_flash_attn() else
                         "odb_varlen: torch varlen_attn (attention dropout, softcap or fp32: per-group SDPA)")
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
        start = self._started = time.perf_counter()
        steps_this_run = 0
        plans = iter(batcher)
        while True:
            began = time.perf_counter()
            spent = (batcher.fetch_s, batcher.plan_s, batcher.aligner.collective_s)
            plan = next(plans, None)  # a round may run here: fetching, planning, one collective
            if plan is None:
                break
            samples = [[self.feed.take(uid) for uid in micro.uids] for micro in plan.micro_batches]
            result = self.engine.train_step(plan, samples, self._lr())
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
                    # each sample's own epoch: in quota mode a step may mix passes over the data
                    audit.write(json.dumps({"epoch": plan.epoch, "step": plan.step, "micro": m,
                                            "ids": [u % size for u in micro.uids],
                                            "epochs": [u // size for u in micro.uids]}) + "\n")
            steps_this_run += 1
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
        self.totals["wall_us"] += round(self.wall_s * 1e6)
        self._started = None
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

    def _report(self) -> np.ndarray:
        """This rank's telemetry vector for the next round (its steps, its whole-run counts)."""
        counts = self.batcher.counts
        lost = counts["skipped"] + counts["dropped"]
        return self.telemetry.report(self.feed.skipped, fetched=self.batcher.observed_samples + lost, lost=lost)

    def _lr(self) -> float:
        """The learning rate of the next step, planned over the samples that will train (join
        mode: skipped and dropped records never train); the same on every rank."""
        total = self.planned
        if self.config.mode == "join":
            total = planned_to_train(total, fetched=self.telemetry.fetched, lost=self.telemetry.lost)
        return self.schedule(self.samples_done, total)

    def _count(self, plan) -> None:
        t = self.totals
        t["steps"] += 1
        self.this_process["steps"] += 1
        self.this_process["samples"] += plan.num_samples
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
        wall_us = self.totals["wall_us"] + (round((time.perf_counter() - self._started) * 1e6)
                                            if self._started is not None else 0)
        run = {"totals": {**self.totals, "wall_us": wall_us}, "skipped": dict(self.feed.skipped),
               "first_losses": (self.first_losses or self.telemetry.losses)[:3],
               "fetched_lost": [self.telemetry.fetched, self.telemetry.lost]}
        (folder / tag / f"run_state.rank{self.rank}.json").write_text(json.dumps(run))
        self.saved = tag

    def _resume(self, tag: str) -> None:
        folder = self.output_dir / "checkpoints"
        tag = (folder / "latest").read_text().strip() if tag == "latest" else tag
        path, client = self.engine.engine.load_checkpoint(str(folder), tag=tag)
        if path is None:
            raise FileNotFoundError(f"--resume: no DeepSpeed checkpoint {folder / tag}")
        state = json.loads((folder / tag / f"odb_state.rank{self.rank}.json").read_text())
        if state["is_done"] and state["config"]["mode"] == "join" and state["epoch"] >= self.args.epochs:
            raise ValueError(f"--resume: the run in {self.output_dir} already trained all {state['epoch']} "
                             f"epoch(s); pass --epochs > {state['epoch']} to train more, or start a new "
                             "--output_dir")
        self.feed.sampler.queue.clear()  # the fresh batcher's first deal is replaced by the state's
        self.batcher.load_state_dict(state)
        self.feed.restore(self.batcher.held_uids())
        self.samples_done, self.steps_done = client["samples_done"], client["steps_done"]
        run_state = folder / tag / f"run_state.rank{self.rank}.json"
        if run_state.is_file():  # whole-run counts, so the summary reports the whole run
            run = json.loads(run_state.read_text())
            self.totals.update(run["totals"])
            self.feed.skipped.update(run["skipped"])
            self.first_losses = run["first_losses"]
            self.fetched_lost = run["fetched_lost"]
        self.this_process["rounds_before"] = self.batcher.round_index
        extended = " (extended to --epochs {})".format(self.args.epochs) if state["is_done"] else ""
        self.log(f"resumed from {folder / tag}: {self.samples_done} samples done{extended}")

    # ---- close ------------------------------------------------------------------------------

    def close(self) -> dict:
        import torch.distributed as dist

        if not self.args.no_final_checkpoint and self.saved != f"step{self.steps_done}":
            self.save(f"step{self.steps_done}")
        keys = sorted(self.totals)
        counts = self.batcher.counts
        own = [self.totals[k] for k in keys] + [counts["truncated"], counts["dropped"]]
        tsize = self.telemetry.size
        gathered = self.batcher.aligner.gather_reports(np.concatenate([self._report(), np.asarray(own, dtype=np.int64)]))
        self.telemetry.on_reports(gathered[:, :tsize])  # completes the last round's steps
        summed = dict(zip(keys + ["truncated", "dropped"], gathered[:, tsize:].sum(axis=0).tolist()))
        if self.feed.examples:
            print(f"rank {self.rank} skipped records, e.g.: " + "; ".join(self.feed.examples), flush=True)
        summary = self._summary(summed)
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

    def _summary(self, summed: dict[str, int]) -> dict:
        """The whole run's figures (resumes included), and this process's apart."""
        wall_s = summed["wall_us"] / 1e6 / self.world_size  # every rank's train loop, averaged
        losses = self.first_losses or self.telemetry.losses  # global per-step losses (rank 0)
        last = self.telemetry.losses[-3:] or losses[-3:]
        mine = self.this_process
        epochs = self.args.epochs if self.config.mode == "join" else round(summed["samples"] / max(1, len(self.dataset)), 4)
        return {
            "world_size": self.world_size, "dataset_samples": len(self.dataset), "epochs": epochs,
            "steps": self.steps_done, "micro_batches": summed["micro_batches"],
            "dummy_micro_batches": summed["dummy_micro_batches"], "samples_emitted": summed["samples"],
            "real_tokens": summed["real_tokens"], "materialized_tokens": summed["materialized_tokens"],
            "padding_ratio": round(1 - summed["real_tokens"] / max(1, summed["materialized_tokens"]), 6),
            "truncated": summed["truncated"], "dropped": summed["dropped"], "skipped": self.telemetry.skipped,
            "loss_first": round(sum(losses[:3]) / max(1, len(losses[:3])), 5),
            "loss_last": round(sum(last) / max(1, len(last)), 5),
            "wall_s": round(wall_s, 3),
            "samples_per_s": round(summed["samples"] / max(1e-9, wall_s), 3),
            "tokens_per_s": round(summed["real_tokens"] / max(1e-9, wall_s), 1),
            "policy": self.config.policy, "rounds": self.batcher.round_index,
            "this_process": {
                "steps": mine["steps"], "samples": mine["samples"],
                "rounds": self.batcher.round_index - mine["rounds_before"],
                "odb_collectives": self.comm.num_collectives,  # start check + one per round + the close
                "wall_s": round(self.wall_s, 3),
                "samples_per_s": round(mine["samples"] / max(1e-9, self.wall_s), 3)},
        }

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
