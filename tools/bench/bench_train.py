#!/usr/bin/env python
"""Training benchmark: the same model, samples and epoch under each batching system, side by side.

    python tools/bench/bench_train.py --trace ../shared/traces/mmmix_like.txt --length_scale 8 \\
        --samples 600 --max_tokens 2048 --world_size 2 --json

Systems (``--systems``, in this order by default):

``fixed``      padded batches of the largest size whose padded batch of the longest samples fits
               ``max_tokens`` (what a user picks to be safe from out-of-memory), static shards
``fixed8``     padded batches of 8 (the common default)
``gmt``, ``bmt``  offline token-budget oracles given every length up front (a length cache for free)
``paper_pkg``  the paper's reference package, ``online-dynamic-batching`` 0.1.2, through its
               documented DataLoader API (tools/bench/paper_pkg_train.py, in a virtual environment of
               its own that this tool creates on first use: the two packages share the import name)
``odb``        this project: packed varlen micro-batches, join mode

Every system trains the same initial weights (a model folder written once from
configs/tiny_model.json), the same processed samples, one epoch, ZeRO-2, AdamW with the same
learning-rate schedule by samples, one rank per process under the deepspeed launcher; on CPU the
machine's cores are split evenly over the ranks. (With CUDA it runs one rank per GPU, bf16 by the
DeepSpeed config's "auto"; that path has not yet been run on a GPU.) Data: ``--trace FILE`` (one ``tokens [patches]``
line per sample: chat records of those token lengths, through the real processing pipeline; vision
patches are not modelled: the tiny model is text-only) or ``--data FILE`` (chat records).
``--length_scale K`` divides a trace's lengths by K (CPU runs: attention over long samples dominates
a CPU; pass a budget scaled alike).

Prints a markdown table and, with ``--json``, as the last line of stdout one JSON object:
``{"trace", "samples", "world_size", "max_tokens", "systems": {name: {"samples_per_s",
"real_tokens_per_s", "materialized_tokens_per_s", "padding_ratio", "steps", "micro_batches",
"final_loss", ...}}}``. The figures come from each run's own summary.json and metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import venv
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SYSTEMS = ("fixed", "fixed8", "gmt", "bmt", "paper_pkg", "odb")
PAPER_PACKAGE = "online-dynamic-batching==0.1.2"
PAPER_ENV = ROOT / ".bench" / "paper_pkg-0.1.2"  # the package's own virtual environment (git-ignored)
BASE_DS_CONFIG = ROOT / "configs" / "ds_zero2.json"


# ---- the workload ----------------------------------------------------------------------------

def prepare(args: argparse.Namespace, work: Path) -> dict:
    """Writes the chat records, the initial model folder and the processed samples (for paper_pkg);
    returns what the runs share."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from odb.data.processing import SampleDataset
    from odb.training.model.build import load_tokenizer

    if args.trace is not None:
        from tools.make.make_trace_data import write_records
        from tools.traces import read_lengths

        data = work / "records.jsonl"
        lengths = [max(1, tokens // args.length_scale) for tokens, _ in read_lengths(str(args.trace))[:args.samples]]
        write_records(lengths, data, seed=args.seed)
    else:
        data = args.data
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    model_dir = work / "model"
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs" / "tiny_model.json"))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    dataset = SampleDataset(data, tokenizer, seed=args.seed, max_samples=args.samples, truncate_to=args.max_tokens)
    samples = []
    for i in range(len(dataset)):
        sample = dataset[i]
        if "skip" not in sample:
            samples.append({"id": i, "input_ids": sample["input_ids"], "labels": sample["labels"]})
    torch.save(samples, work / "samples.pt")
    from tools.sim.simulate_cluster import fixed_batch_for

    lengths = {s["id"]: len(s["input_ids"]) for s in samples}
    return {"data": data, "model": model_dir, "samples_file": work / "samples.pt", "dataset_size": len(dataset),
            "lengths": lengths, "safe_batch": fixed_batch_for([(n, 0) for n in lengths.values()], args.max_tokens)}


# ---- running one system ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh(folder: Path) -> Path:
    """A run's folder, emptied (its audit files append)."""
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def _launch(python: str, script: Path, script_args: list[str], args: argparse.Namespace, log: Path) -> None:
    """``script`` on ``--world_size`` ranks under the deepspeed launcher run by ``python``; the cores
    split evenly over the ranks; the launcher's CPU all-reduce buffers removed after."""
    port = free_port()
    cmd = [python, "-c", "from deepspeed.launcher.runner import main; main()", "--num_gpus", str(args.world_size),
           "--master_port", str(port), str(script), *script_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not torch.cuda.is_available():  # CPU ranks: DeepSpeed's CPU accelerator, the cores split over the ranks
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.world_size)))
    try:
        with open(log, "w") as out:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    finally:
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            path.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} failed (exit {done.returncode}); its log {log} ends:\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))


def project_settings(system: str, args: argparse.Namespace, shared: dict, **settings) -> dict:
    """The odb config of fixed, fixed8, gmt, bmt or odb (any other name): configs/odb.json at
    ``--max_tokens`` and ``--window``, the system's policy, then ``settings``."""
    config = json.loads((ROOT / "configs" / "odb.json").read_text())
    config.update(max_tokens=args.max_tokens, window=args.window)
    if system.startswith("fixed"):
        config.update(policy="fixed", sharding="static",
                      batch_size=shared["safe_batch"] if system == "fixed" else 8)
        config["window"] = max(config["window"], config["batch_size"])
    elif system in ("gmt", "bmt"):
        config.update(policy=system, sharding="static")  # offline: every length of its shard up front
    return {**config, **settings}


def project_config(system: str, args: argparse.Namespace, shared: dict, **settings):
    """:func:`project_settings` as the :class:`~odb.batching.config.OdbConfig` the runs read."""
    from odb.batching.config import OdbConfig

    return OdbConfig(**project_settings(system, args, shared, **settings))


def run_project(system: str, args: argparse.Namespace, shared: dict, work: Path, extra: list[str] = (), *,
                settings: dict | None = None) -> Path:
    """fixed, fixed8, gmt, bmt or odb (any other name) through launch/train.py, with ``extra`` flags
    and the odb ``settings`` over :func:`project_settings`; returns the run's folder."""
    (work / f"{system}.json").write_text(json.dumps(project_settings(system, args, shared, **(settings or {}))))
    out = _fresh(work / system)
    _launch(sys.executable, ROOT / "launch" / "train.py", [
        "--odb_config", str(work / f"{system}.json"), "--deepspeed_config", str(BASE_DS_CONFIG),
        "--model", str(shared["model"]), "--data", str(shared["data"]), "--max_samples", str(args.samples),
        "--output_dir", str(out), "--no_final_checkpoint", "--audit_ids", "--num_workers", str(args.num_workers),
        "--seed", str(args.seed), "--lr", str(args.lr), *extra], args, work / f"{system}.log")
    return out


def paper_python() -> str:
    """The python of the paper package's virtual environment, made on first use: it sees this
    environment's torch, transformers and DeepSpeed (the same versions as the other systems) through
    a .pth file, but not this project's ``odb``, and holds the package itself."""
    python = PAPER_ENV / "bin" / "python"
    if python.exists():
        return str(python)
    import site

    venv.EnvBuilder(with_pip=True, clear=True).create(PAPER_ENV)
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    Path(own, "odb_bench_shared.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", PAPER_PACKAGE], check=True)
    probe = "import odb, deepspeed, transformers; print(odb.__version__, odb.__file__)"
    check = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True,
                           cwd=PAPER_ENV).stdout.split()[-2:]
    if check[0] != "0.1.2" or str(ROOT / "odb") in check[1]:
        shutil.rmtree(PAPER_ENV)
        raise RuntimeError(f"the paper package's environment imports the wrong odb: {check}")
    return str(python)


def run_paper(args: argparse.Namespace, shared: dict, work: Path, extra: list[str] = (), *,
              name: str = "paper_pkg") -> Path:
    """tools/bench/paper_pkg_train.py with ``extra`` flags, in the package's environment; returns the
    run's folder (``work / name``)."""
    out = _fresh(work / name)
    _launch(paper_python(), ROOT / "tools" / "bench" / "paper_pkg_train.py", [
        "--samples", str(shared["samples_file"]), "--model", str(shared["model"]),
        "--deepspeed_config", str(BASE_DS_CONFIG), "--token_budget", str(args.max_tokens),
        "--buffer", str(args.window), "--num_workers", str(args.num_workers), "--lr", str(args.lr),
        "--seed", str(args.seed), "--out", str(out), *extra], args, work / f"{name}.log")
    return out


def count_paper_batches(args: argparse.Namespace, shared: dict, work: Path, epochs: int = 1) -> list[int]:
    """The paper package's batches in each of ``epochs`` epochs, the most of any rank (its loader
    run without a model)."""
    out = run_paper(args, shared, work, ["--count_only", "--epochs", str(epochs)], name="paper_pkg_count")
    return [max(counts) for counts in zip(*json.loads((out / "counts.json").read_text())["batches_per_rank"])]


# ---- figures ---------------------------------------------------------------------------------

def micro_batches(out: Path) -> list[list[int]]:
    """The sample ids of every micro-batch every rank trained (the runs' emitted-id files)."""
    return [json.loads(line)["ids"] for path in sorted(out.glob("emitted_ids.rank*.jsonl"))
            for line in path.read_text().splitlines()]


def coverage(batches: list[list[int]], dataset_size: int) -> dict:
    """How many samples trained once, more than once, or never."""
    seen = Counter(i for ids in batches for i in ids)
    times = Counter(seen[i] for i in range(dataset_size))
    return {"once": times[1], "never": times[0], "more_than_once": dataset_size - times[1] - times[0]}


def attention_area(batches: list[list[int]], lengths: dict[int, int], *, packed: bool) -> int:
    """The causal attention's work over the run, in query x key tokens: each packed sample attends
    to itself only (the sum of its length squared); a padded batch computes every row to its
    longest sample (rows x longest squared)."""
    if packed:
        return sum(lengths[i] ** 2 for ids in batches for i in ids)
    return sum(len(ids) * max(lengths[i] for i in ids) ** 2 for ids in batches if ids)


def figures(system: str, out: Path, shared: dict) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    wall, batches = summary["wall_s"], micro_batches(out)
    row = {
        "samples_per_s": summary["samples_per_s"], "real_tokens_per_s": summary["tokens_per_s"],
        "materialized_tokens_per_s": round(summary["materialized_tokens"] / max(1e-9, wall), 1),
        "padding_ratio": summary["padding_ratio"], "steps": summary["steps"],
        "micro_batches": summary["micro_batches"], "dummy_micro_batches": summary["dummy_micro_batches"],
        "final_loss": summary["loss_last"], "first_loss": summary["loss_first"], "wall_s": wall,
        "samples": summary["samples_emitted"], "coverage": coverage(batches, shared["dataset_size"]),
        "attention_area": attention_area(batches, shared["lengths"], packed=system == "odb"),
    }
    metrics = out / "metrics.jsonl"
    if metrics.exists():  # the project's runs: per-step times of the data wait and of odb's own work
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_s" in r]
        total = sum(r["step_s"] for r in steps)
        row.update(
            data_wait_share=round(sum(r["data_wait_s"] for r in steps) / max(1e-9, wall), 4),
            planning_share=round(sum(r["odb_plan_s"] + r["odb_collective_s"] for r in steps) / max(1e-9, wall), 4),
            sync_efficiency=round(sum(r["sync_efficiency"] * r["step_s"] for r in steps) / max(1e-9, total), 4))
    else:  # paper_pkg: its grouping runs in a separate process; the trainer sees only the wait for it
        row.update(data_wait_share=round(summary["data_wait_s"] / max(1e-9, wall), 4), planning_share=None,
                   sync_efficiency=None)
    if system == "fixed":
        row["batch_size"] = shared["safe_batch"]
    return row


def markdown(result: dict) -> str:
    systems = result["systems"]
    base = systems.get("odb", {}).get("samples_per_s")
    lines = ["| system | samples/s | odb is | real tok/s | materialized tok/s | padding | steps | micro-batches "
             "| attention work | data wait | planning | final loss | trained once |", "|" + "---|" * 13]
    for name, r in systems.items():
        label = f"fixed (batch {r['batch_size']})" if name == "fixed" else name
        speed = f"{base / r['samples_per_s']:.2f}x" if base and r["samples_per_s"] else "-"
        planning = f"{r['planning_share']:.1%}" if r["planning_share"] is not None else "-"
        lines.append(f"| {label} | {r['samples_per_s']:.2f} | {speed} | {r['real_tokens_per_s']:.0f} | "
                     f"{r['materialized_tokens_per_s']:.0f} | {r['padding_ratio']:.3f} | {r['steps']} | "
                     f"{r['micro_batches']} | {r['attention_area'] / 1e6:.1f}M | {r['data_wait_share']:.1%} | "
                     f"{planning} | {r['final_loss']:.3f} | "
                     f"{r['coverage']['once']}/{result['samples']} |")
    return "\n".join(lines)


def parse_run_arguments(parser: argparse.ArgumentParser, argv: list[str] | None, systems) -> argparse.Namespace:
    """``parser``'s arguments and the runs' own (workers, learning rate, seed, folders, timeout,
    JSON), parsed; ``--systems`` (a comma-separated string) checked against ``systems``, as a list."""
    parser.add_argument("--num_workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep every run's folder and log here")
    parser.add_argument("--timeout_s", type=int, default=3600, help="per run")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(systems))
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(systems)}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="a length trace (one 'tokens [patches]' line per sample)")
    source.add_argument("--data", type=Path, help="chat records (default: the bundled data/chat.jsonl)")
    parser.add_argument("--samples", type=int, default=600, help="the first N samples of the trace or data")
    parser.add_argument("--max_tokens", type=int, default=2048, help="the token budget per micro-batch")
    parser.add_argument("--length_scale", type=int, default=1, help="divide the trace's lengths by this")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--world_size", type=int, default=1, choices=(1, 2, 4, 8))
    parser.add_argument("--window", type=int, default=256, help="odb's window = the paper package's buffer")
    args = parse_run_arguments(parser, argv, SYSTEMS)
    if args.trace is None and args.data is None:
        args.data = ROOT / "data" / "chat.jsonl"
    for flag in ("samples", "max_tokens", "length_scale", "window", "num_workers"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def bench(name: str, args: argparse.Namespace, prepare_runs, head, run_one, table) -> dict:
    """Every system of ``args.systems`` in turn in one work folder (``--keep``, else a temporary
    one): ``prepare_runs(args, work)`` makes what the runs share, ``head(shared)`` the result's own
    fields, ``run_one(system, shared, work)`` one system's figures; prints ``table(result)`` (and
    the JSON with ``--json``) and returns the result."""
    with tempfile.TemporaryDirectory(prefix=f"{name}_") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        shared = prepare_runs(args, work)
        result = {**head(shared), "world_size": args.world_size, "max_tokens": args.max_tokens,
                  "length_scale": args.length_scale, "systems": {}}
        for system in args.systems:
            print(f"{name}: {system} ...", file=sys.stderr, flush=True)
            result["systems"][system] = run_one(system, shared, work)
    print(table(result))
    if args.json:
        print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)

    def run_one(system: str, shared: dict, work: Path) -> dict:
        out = run_paper(args, shared, work) if system == "paper_pkg" else run_project(system, args, shared, work)
        return figures(system, out, shared)

    return bench("bench_train", args, prepare, lambda shared: {
        "trace": str(args.trace.name if args.trace else args.data.name), "samples": shared["dataset_size"]},
        run_one, markdown)


if __name__ == "__main__":
    main()
