#!/usr/bin/env python
"""Preference training, odb against TRL's own DPOTrainer: the same model, pairs, reference,
objective and schedule at 2 CPU ranks; pairs/s, padding, and the time to a target eval reward
accuracy.

    python tools/bench/bench_trl_dpo.py                  # 400 train + 128 eval pairs, 3 epochs, the table
    python tools/bench/bench_trl_dpo.py --passes 2 --keep runs/trl_dpo --json   # each system's faster pass

The pairs (:func:`make_pairs`, seeded, written here as TRL's conversational JSONL with an explicit
prompt, which both systems read): the words of the bundled data (``make_bundled_data.WORDS``) in two
groups, alternate words each. A prompt, ``Continue with words like: w1 w2 ...``, lists words of one
group; the chosen answer is words of that group, the rejected answer words of the other. Which group
a pair takes is a coin flip, so neither group is better on its own: the rule is learnt only from the
prompt. The number of words is log-normal, drawn independently for the prompt (median
``--prompt_words``) and each answer (median ``--answer_words``, sigma 0.8, up to
``--max_answer_words``): long tails, and a pair's two answers of unrelated lengths. The first
``--eval_pairs`` of a seeded shuffle are held out for evaluation (no record is in both).

What the two systems share:

- the initial weights: ``configs/tiny_model.json`` initialised once with ``--seed``, saved with the
  bundled tokenizer as one folder both load;
- the tokens: the tokenizer's chat template over the prompt then each answer, the answer's tokens
  and its end-of-turn token scored; checked here (``same_tokens``): TRL's tokenized pairs have the
  same sequence and completion lengths as odb's pair samples;
- the reference: the initial weights, their log-probs of every train and eval pair computed once
  before training (TRL ``precompute_ref_log_probs=True``; odb ``--reference precompute``);
- the objective: DPO's sigmoid loss at ``--beta``, mean over the step's pairs; the reward accuracy
  (the share of pairs whose chosen reward is the higher) over the same held-out pairs every
  ``--eval_steps`` optimizer steps;
- the optimizer: AdamW, ``--lr``, no weight decay, gradient clipping 1.0, fp32, warmup over 3% of
  the run then cosine to a tenth of ``--lr``, one optimizer step per micro-batch (no accumulation);
- the pairs trained: ``--epochs`` passes over the train split;
- 2 ranks on the same 2 cores, one thread each.

Where they differ, as each is built:

- the batch: TRL trains a fixed ``--batch_size`` B pairs a rank (2B rows padded to the longest), odb
  packs pairs under a token budget; ``--max_tokens`` (default) is B times a pair's mean tokens, so
  that odb's pairs per step come close to TRL's 2B per step over 2 ranks (both are reported), with
  the longest pair within it (else an error names the flags to change);
- the steps: TRL's is epochs x pairs / 2B; odb's is what its packing makes of the same pairs (the
  learning-rate schedule follows each one's own progress: TRL's by steps, odb's by pairs);
- the engine: TRL under torchrun as DDP on gloo, odb under the deepspeed launcher as ZeRO-2
  (configs/ds_zero2.json; both give every rank the same averaged gradient);
- the data order: each system's own seeded shuffle (TRL's DistributedSampler, odb's dynamic shards).

Figures per system: pairs per optimizer step, optimizer steps, pairs trained, training seconds
(the sum of the steps' wall times on rank 0, evaluations left out: odb's ``step_s`` rows; TRL's time
between steps' ends, :mod:`tools.bench.trl_dpo_train`), pairs/s over that time, padding (TRL's:
the attention masks' zeros over their size, counted in its training batches; odb's: counted from its
audit, ``bench_preference.recount``, packed so 0), the first evaluation at or over ``--target`` (its
step and the training seconds up to it), and the best and final eval reward accuracy. ``--passes N``
runs the systems in turn N times and reports each one's fastest pass (the machine is shared: load
from other work only slows a run), with every pass's pairs/s and time to target beside, and the
1-minute load average before and after each run (every pass's eval curve in ``--json``'s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.make.make_bundled_data import WORDS  # noqa: E402

__all__ = ["GROUPS", "curve_from_odb", "curve_from_trl", "first_reach", "make_pairs", "split_pairs"]

GROUPS = (WORDS[0::2], WORDS[1::2])
"""The two word groups: a chosen answer takes its prompt's group, a rejected one the other."""
PROMPT = "Continue with words like: "
SYSTEMS = ("trl", "odb")
DS_CONFIG = ROOT / "configs" / "ds_zero2.json"
ODB_CONFIG = ROOT / "configs" / "odb.json"


# ---- the pairs -------------------------------------------------------------------------------

def make_pairs(num_pairs: int, seed: int, *, prompt_words: float = 4, answer_words: float = 10,
               max_prompt_words: int = 16, max_answer_words: int = 80) -> list[dict]:
    """``num_pairs`` distinct pairs as TRL's conversational records with an explicit prompt (see
    the module docstring); seeded."""
    rng = random.Random(seed)

    def count(median: float, sigma: float, high: int) -> int:
        return min(high, max(1, round(rng.lognormvariate(0.0, sigma) * median)))

    def words(group: tuple[str, ...], n: int) -> str:
        return " ".join(rng.choice(group) for _ in range(n))

    records, seen = [], set()
    while len(records) < num_pairs:
        group = rng.randrange(2)
        own, other = GROUPS[group], GROUPS[1 - group]
        prompt = PROMPT + words(own, max(2, count(prompt_words, 0.5, max_prompt_words)))
        chosen = words(own, count(answer_words, 0.8, max_answer_words))
        rejected = words(other, count(answer_words, 0.8, max_answer_words))
        if (prompt, chosen, rejected) in seen:
            continue
        seen.add((prompt, chosen, rejected))
        records.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
    return records


def split_pairs(records: list[dict], num_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): the first ``num_eval`` of a seeded shuffle held out, the rest for training."""
    if not 0 < num_eval < len(records):
        raise ValueError(f"--eval_pairs must be between 1 and {len(records) - 1}, got {num_eval}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order[num_eval:]], [records[i] for i in order[:num_eval]]


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- time to target --------------------------------------------------------------------------

def first_reach(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """The step and training seconds of the first evaluation (``curve``: (step, training seconds,
    accuracy), in step order) whose accuracy is at or over ``target``; None if none is."""
    for step, seconds, accuracy in curve:
        if accuracy >= target:
            return step, seconds
    return None


def _cumulative(step_s: list[float]) -> list[float]:
    """Training seconds up to each step (index i: after step i + 1)."""
    total, out = 0.0, []
    for seconds in step_s:
        total += seconds
        out.append(total)
    return out


def curve_from_odb(rows: list[dict]) -> tuple[list[tuple[int, float, float]], list[float]]:
    """odb's metrics.jsonl rows as (the eval curve, each step's seconds). A row's ``step`` is the
    step's index (from 0); an eval row's, that of the step it follows: after ``step + 1`` steps."""
    step_s = [r["step_s"] for r in sorted((r for r in rows if "step_s" in r), key=lambda r: r["step"])]
    upto = _cumulative(step_s)
    curve = [(r["step"] + 1, upto[r["step"]], r["eval_rewards/accuracies"]) for r in rows
             if "eval_rewards/accuracies" in r]
    return curve, step_s


def curve_from_trl(run: dict) -> tuple[list[tuple[int, float, float]], list[float]]:
    """trl_dpo_train.py's ``trl_run.json`` as (the eval curve, each step's seconds)."""
    upto = _cumulative(run["step_s"])
    curve = [(r["step"], upto[r["step"] - 1], r["eval_rewards/accuracies"]) for r in run["log_history"]
             if "eval_rewards/accuracies" in r]
    return curve, run["step_s"]


# ---- the shared workload ---------------------------------------------------------------------

def prepare(args: argparse.Namespace, work: Path) -> dict:
    """Writes the splits and the initial model folder; the pairs' token lengths as odb takes them,
    and odb's budget."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from odb.data.processing import SampleDataset
    from odb.training.model.build import load_tokenizer

    records = make_pairs(args.train_pairs + args.eval_pairs, args.seed, prompt_words=args.prompt_words,
                         answer_words=args.answer_words, max_answer_words=args.max_answer_words)
    train, held_out = split_pairs(records, args.eval_pairs, args.seed)
    train_file, eval_file = write_jsonl(train, work / "train.jsonl"), write_jsonl(held_out, work / "eval.jsonl")
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    model_dir = work / "model"
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs" / "tiny_model.json"))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with tempfile.TemporaryDirectory(prefix="bench_trl_dpo_") as cache:
        data = SampleDataset(train_file, tokenizer, pairs=True, cache_dir=cache)
        lengths = [_pair_lengths(data[i]) for i in range(len(data))]
    pair_tokens = [c + r for c, r, _, _ in lengths]
    mean = sum(pair_tokens) / len(pair_tokens)
    max_tokens = args.max_tokens or math.ceil(args.batch_size * mean)
    if max(pair_tokens) > max_tokens:
        raise SystemExit(f"error: the longest pair has {max(pair_tokens)} tokens, over odb's max_tokens {max_tokens} "
                         f"({args.batch_size} x the mean pair, {mean:.1f}): raise --batch_size or --max_tokens, or "
                         "lower --max_answer_words")
    return {"train": train_file, "eval": eval_file, "model": model_dir, "lengths": lengths,
            "mean_pair_tokens": round(mean, 1), "longest_pair_tokens": max(pair_tokens), "max_tokens": max_tokens}


def _pair_lengths(sample: dict) -> tuple[int, int, int, int]:
    """A pair sample's two sequence lengths and each answer's scored tokens (chosen, rejected)."""
    chosen, rejected = sample["pair"]
    labels = sample["labels"].tolist()
    return chosen, rejected, sum(t != -100 for t in labels[:chosen]), sum(t != -100 for t in labels[chosen:])


# ---- running the systems ---------------------------------------------------------------------

def _launch(cmd: list[str], log: Path, args: argparse.Namespace) -> None:
    """One 2-rank run (``cmd``), the cores split over the ranks, its output in ``log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.world_size)), "TRL_EXPERIMENTAL_SILENCE": "1"}
    try:
        with open(log, "w") as out:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    finally:
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{args.port}_*"):
            path.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed (exit {done.returncode}); its log {log} ends:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))


def trl_command(args: argparse.Namespace, shared: dict, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
            "--master_port", str(args.port), str(ROOT / "tools" / "bench" / "trl_dpo_train.py"),
            "--model", str(shared["model"]), "--train", str(shared["train"]), "--eval", str(shared["eval"]),
            "--out", str(out), "--batch_size", str(args.batch_size), "--epochs", str(args.epochs),
            "--eval_steps", str(args.eval_steps), "--beta", str(args.beta), "--lr", str(args.lr),
            "--seed", str(args.seed)]


def odb_command(args: argparse.Namespace, shared: dict, out: Path) -> list[str]:
    return [sys.executable, "-c", "from deepspeed.launcher.runner import main; main()", "--num_gpus",
            str(args.world_size), "--master_port", str(args.port), str(ROOT / "launch" / "train.py"),
            "--deepspeed_config", str(DS_CONFIG), "--odb_config", str(ODB_CONFIG), "--model", str(shared["model"]),
            "--data", str(shared["train"]), "--eval_data", str(shared["eval"]), "--eval_steps", str(args.eval_steps),
            "--objective", "dpo", "--reference", "precompute", "--beta", str(args.beta), "--lr", str(args.lr),
            "--epochs", str(args.epochs), "--max_tokens", str(shared["max_tokens"]), "--seed", str(args.seed),
            "--output_dir", str(out), "--audit_ids", "--no_final_checkpoint", "--log_steps", "0"]


def run_trl(args: argparse.Namespace, shared: dict, work: Path, name: str = "trl") -> dict:
    out = _fresh(work / name)
    _launch(trl_command(args, shared, out), work / f"{name}.log", args)
    run = json.loads((out / "trl_run.json").read_text())
    curve, step_s = curve_from_trl(run)
    pairs, materialized = run["rows"] // 2, run["materialized_tokens"]
    figures = _figures("trl", curve, step_s, pairs=pairs, padding_ratio=round(1 - run["real_tokens"] / materialized, 4),
                       materialized_per_pair=round(materialized / pairs, 1),
                       eval_s=sum(e["eval_s"] for e in run["evals"]))
    figures["same_tokens"] = [tuple(x) for x in run["lengths"]] == list(shared["lengths"])  # as odb's samples'
    return figures


def run_odb(args: argparse.Namespace, shared: dict, work: Path, name: str = "odb") -> dict:
    from tools.bench.bench_preference import recount

    out = _fresh(work / name)
    _launch(odb_command(args, shared, out), work / f"{name}.log", args)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve, step_s = curve_from_odb(rows)
    counted = recount(out)  # (from the audit: every micro-batch's pairs, as the model took them)
    return _figures("odb", curve, step_s, pairs=counted["pairs"], padding_ratio=counted["padding_ratio"],
                    materialized_per_pair=counted["materialized_per_pair"],
                    eval_s=sum(r["eval_s"] for r in rows if "eval_s" in r))


def _fresh(folder: Path) -> Path:
    """A run's folder, emptied (odb's audit files append)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _figures(system: str, curve: list, step_s: list[float], *, pairs: int, padding_ratio: float,
             materialized_per_pair: float, eval_s: float) -> dict:
    train_s = sum(step_s)
    return {"system": system, "steps": len(step_s), "pairs": pairs, "pairs_per_step": round(pairs / len(step_s), 2),
            "train_s": round(train_s, 2), "pairs_per_s": round(pairs / train_s, 2), "padding_ratio": padding_ratio,
            "materialized_per_pair": materialized_per_pair, "eval_s": round(eval_s, 2),
            "curve": [[s, round(t, 2), a] for s, t, a in curve],
            "best_eval_accuracy": max(a for _, _, a in curve), "final_eval_accuracy": curve[-1][2]}


# ---- the report ------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    target = result["target"]
    lines = [f"| system | pairs / step | steps | pairs | training s | pairs/s | padding | materialized tokens / pair "
             f"| steps to {target} | training s to {target} | best eval accuracy | final eval accuracy |",
             "|" + "---|" * 12]
    for r in result["systems"].values():
        reached = r["reached"]
        lines.append(f"| {r['system']} | {r['pairs_per_step']:.2f} | {r['steps']} | {r['pairs']} | "
                     f"{r['train_s']:.1f} | {r['pairs_per_s']:.2f} | {r['padding_ratio']:.3f} | "
                     f"{r['materialized_per_pair']:.1f} | "
                     f"{reached[0] if reached else 'not reached'} | {f'{reached[1]:.1f}' if reached else '-'} | "
                     f"{r['best_eval_accuracy']:.3f} | {r['final_eval_accuracy']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_pairs", type=int, default=400)
    parser.add_argument("--eval_pairs", type=int, default=128)
    parser.add_argument("--prompt_words", type=float, default=4, help="the prompt's median number of words")
    parser.add_argument("--answer_words", type=float, default=10, help="an answer's median number of words")
    parser.add_argument("--max_answer_words", type=int, default=80)
    parser.add_argument("--batch_size", type=int, default=4, help="TRL's pairs a rank's batch")
    parser.add_argument("--max_tokens", type=int, default=0,
                        help="odb's token budget (0: --batch_size x the mean pair's tokens)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval_steps", type=int, default=10)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--target", type=float, default=0.9, help="the eval reward accuracy to reach")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of trl, odb")
    parser.add_argument("--passes", type=int, default=1, help="run each system N times, keep its fastest")
    parser.add_argument("--port", type=int, default=29731, help="the runs' master port (one run at a time)")
    parser.add_argument("--seed", type=int, default=0, help="the pairs', the split's, the weights' and the runs'")
    parser.add_argument("--keep", type=Path, help="keep the work folder (data, model, runs, logs) here")
    parser.add_argument("--timeout_s", type=int, default=1800, help="per run")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or set(args.systems) - set(SYSTEMS):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    for flag in ("train_pairs", "eval_pairs", "batch_size", "epochs", "eval_steps", "world_size", "passes"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run = {"trl": run_trl, "odb": run_odb}
    with tempfile.TemporaryDirectory(prefix="bench_trl_dpo_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        shared = prepare(args, work)
        result = {"train_pairs": args.train_pairs, "eval_pairs": args.eval_pairs, "epochs": args.epochs,
                  "world_size": args.world_size, "trl_batch_size": args.batch_size,
                  "odb_max_tokens": shared["max_tokens"],
                  "mean_pair_tokens": shared["mean_pair_tokens"], "longest_pair_tokens": shared["longest_pair_tokens"],
                  "beta": args.beta, "lr": args.lr, "eval_steps": args.eval_steps, "target": args.target,
                  "seed": args.seed, "systems": {}}
        passes: dict[str, list[dict]] = {system: [] for system in args.systems}
        for number in range(1, args.passes + 1):  # the systems in turn, pass after pass
            for system in args.systems:
                print(f"bench_trl_dpo: {system}, pass {number} ...", file=sys.stderr, flush=True)
                load_before = os.getloadavg()[0]  # (the machine is shared: how busy it was, around the run)
                figures = run[system](args, shared, work, system if number == 1 else f"{system}_{number}")
                figures["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                figures["reached"] = first_reach(figures["curve"], args.target)
                passes[system].append(figures)
        for system, runs in passes.items():  # load from other work only slows a run: its fastest pass
            result["systems"][system] = {**min(runs, key=lambda r: r["train_s"]),
                                         "pass_pairs_per_s": [r["pairs_per_s"] for r in runs],
                                         "pass_reached": [r["reached"] for r in runs],
                                         "pass_curves": [r["curve"] for r in runs]}
    print(f"pairs: {args.train_pairs} train, {args.eval_pairs} eval; tokens a pair mean {shared['mean_pair_tokens']}, "
          f"longest {shared['longest_pair_tokens']}; TRL {args.batch_size} pairs a rank, odb max_tokens "
          f"{shared['max_tokens']}; {args.world_size} ranks, {args.epochs} epochs, eval every {args.eval_steps} steps")
    print(markdown(result))
    for r in result["systems"].values():
        same = f"TRL's tokens the same as odb's samples: {r['same_tokens']}; " if "same_tokens" in r else ""
        print(f"{r['system']}: {same}pairs/s of every pass "
              f"{r['pass_pairs_per_s']}, (steps, training s) to {args.target} {r['pass_reached']}; the fastest pass: "
              f"evaluations {r['eval_s']} s, load average {r['load_1min'][0]} before, {r['load_1min'][1]} after, eval "
              "curve (step, training s, accuracy): " + ", ".join(f"({s}, {t}, {a:.3f})" for s, t, a in r["curve"]))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
