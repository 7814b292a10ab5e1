#!/usr/bin/env python
"""Peak memory of the loss alone: the full-logits loss against odb's chunked loss; and, with
``--checkpointing``, of a model's forward and backward without and with activation checkpointing.

    python tools/bench/bench_memory.py --vocab 152064 --hidden 1024 --tokens 8192 --json
    python tools/bench/bench_memory.py --checkpointing --layers 8 --hidden 512 --vocab 32000 --tokens 4096 --json

From a random ``hidden [tokens, hidden]`` (requiring grad) and an LM head ``weight [vocab, hidden]``,
forward and backward of the head and the summed next-token cross entropy, once each way:

* full: ``token_loss_sum(head(hidden))``, the row's logits and their fp32 copy (odb's old loss);
* chunked: :func:`odb.training.step.loss.chunked_token_loss_sum`, ``ceil(tokens / chunk)`` chunks.

Each path runs in a fresh process, so one path's freed memory cannot hide the other's. On CPU the
peak is the process's peak resident set (``getrusage(RUSAGE_SELF).ru_maxrss``) minus its resident
set just before the loss (inputs made and touched): real allocations, whatever allocator made
them. The processes run with glibc's ``MALLOC_MMAP_THRESHOLD_=65536``, so every block over 64 KiB
is its own mapping and goes back to the system when freed: otherwise freed blocks under glibc's
dynamic threshold (up to 32 MiB) stay resident and count as live (measured: 32000 x 256 x 2048,
8 chunks: 844 MB without, 252 MB with; the full-logits path's blocks are mapped either way). On
CUDA it is ``torch.cuda.max_memory_allocated()`` minus the memory allocated before. Both include
the weight's gradient (``vocab x hidden``), which either path must make. The processes save their
gradients and this one compares them. The last line of stdout is one JSON object (with
``--json``): the settings, ``full_loss_peak_mb``, ``chunked_loss_peak_mb``, their ``ratio``, both
losses, ``max_abs_grad_diff`` (over the hidden and the weight gradients, also reported apart;
``max_rel_grad_diff`` divides it by the largest gradient entry) and the seconds each path took.

``--checkpointing``: a random-init Llama of ``--layers`` x ``--hidden`` built by odb's
``build_model`` (without and with ``gradient_checkpointing``), one packed row of ``--tokens`` tokens
in samples of 512 through odb's varlen attention, forward to the final hidden states and backward
(the head and loss left out: they are the same either way). Reported the same way:
``plain_peak_mb``, ``checkpointing_peak_mb``, ``ratio``, ``max_rel_grad_diff`` over every weight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from odb.training.step.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    chunked_token_loss_sum,
    softcap_logits,
    token_loss_sum,  # noqa: E402
)

PATHS = ("full", "chunked")
MODEL_PATHS = ("plain", "checkpointing")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_LOSS_CHUNK_TOKENS,
                        help="tokens per chunk of the chunked loss")
    parser.add_argument("--softcap", type=float, default=None, help="final logit soft-capping (Gemma-2: 30)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="hidden and head precision (bfloat16: CUDA only; the loss is fp32 either way)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--checkpointing", action="store_true",
                        help="measure a model's forward + backward without and with activation checkpointing")
    parser.add_argument("--layers", type=int, default=8, help="--checkpointing: decoder layers")
    parser.add_argument("--path", choices=PATHS + MODEL_PATHS, help=argparse.SUPPRESS)  # a child: one path
    parser.add_argument("--grads-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dtype == "bfloat16" and args.device == "cpu":
        parser.error("--dtype bfloat16 is for CUDA; CPU measures fp32")
    return args


def resident_kb() -> int:
    """This process's resident set now, in KiB (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def run_model_path(args: argparse.Namespace) -> dict:
    """``--checkpointing``, one path in this process: the model, then the measured forward and backward."""
    from odb.data.collate import collate_packed
    from odb.training.model.build import build_model

    config = {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
              "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
              "num_attention_heads": max(1, args.hidden // 64), "max_position_embeddings": 8192}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec:
        json.dump(config, spec)
    model = build_model(spec.name, seed=args.seed, vocab_size=args.vocab,
                        gradient_checkpointing=args.path == "checkpointing")
    gen = torch.Generator().manual_seed(args.seed)
    sizes = [512] * (args.tokens // 512) + ([args.tokens % 512] if args.tokens % 512 else [])
    batch = collate_packed([{"input_ids": torch.randint(0, args.vocab, (n,), generator=gen).tolist()} for n in sizes])
    batch.pop("labels")
    base = resident_kb()
    start = time.perf_counter()
    hidden = model.model(**batch, use_cache=False).last_hidden_state
    hidden.float().pow(2).mean().backward()
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    seconds = time.perf_counter() - start
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, args.grads_out)
    return {"peak_mb": peak_mb, "loss": float(hidden.float().pow(2).mean()), "seconds": seconds}


def run_path(args: argparse.Namespace) -> dict:
    """One path in this process: inputs, then the measured forward and backward."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=gen)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
    num_chunks = math.ceil(args.tokens / args.chunk_tokens)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resident_kb()
    start = time.perf_counter()
    if args.path == "full":
        loss = token_loss_sum(softcap_logits(head(hidden[None]), args.softcap), labels[None])
    else:
        loss = chunked_token_loss_sum(hidden[None], labels[None], head, num_chunks=num_chunks, softcap=args.softcap)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    seconds = time.perf_counter() - start
    torch.save({"hidden": hidden.grad.float().cpu(), "weight": head.weight.grad.float().cpu()}, args.grads_out)
    return {"peak_mb": peak_mb, "loss": float(loss), "seconds": seconds, "num_chunks": num_chunks}


def child(args: argparse.Namespace, path: str, grads_out: Path) -> dict:
    cmd = [sys.executable, __file__, "--path", path, "--grads-out", str(grads_out), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--tokens", str(args.tokens), "--chunk-tokens", str(args.chunk_tokens),
           "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    if args.softcap is not None:
        cmd += ["--softcap", str(args.softcap)]
    if path in MODEL_PATHS:
        cmd += ["--layers", str(args.layers)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the {path} path failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse()
    if args.path is not None:
        print(json.dumps(run_model_path(args) if args.path in MODEL_PATHS else run_path(args)))
        return
    if args.checkpointing:
        checkpointing(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        runs = {path: child(args, path, Path(tmp) / f"{path}.pt") for path in PATHS}
        grads = {path: torch.load(Path(tmp) / f"{path}.pt") for path in PATHS}
    diffs = {name: float((grads["chunked"][name] - grads["full"][name]).abs().max()) for name in ("hidden", "weight")}
    largest = max(float(grads["full"][name].abs().max()) for name in ("hidden", "weight"))
    full, chunked = runs["full"], runs["chunked"]
    report = {
        "vocab": args.vocab, "hidden": args.hidden, "tokens": args.tokens, "chunk_tokens": args.chunk_tokens,
        "num_chunks": chunked["num_chunks"], "softcap": args.softcap, "device": args.device, "dtype": args.dtype,
        "measure": "cuda max_memory_allocated" if args.device.startswith("cuda")
        else "ru_maxrss - rss before, glibc mmap threshold 64 KiB",
        "full_loss_peak_mb": round(full["peak_mb"], 1), "chunked_loss_peak_mb": round(chunked["peak_mb"], 1),
        "ratio": round(chunked["peak_mb"] / full["peak_mb"], 4),
        "full_loss": full["loss"], "chunked_loss": chunked["loss"],
        "loss_rel_diff": abs(chunked["loss"] - full["loss"]) / abs(full["loss"]),
        "max_abs_grad_diff": max(diffs.values()), "max_abs_grad_diff_hidden": diffs["hidden"],
        "max_abs_grad_diff_weight": diffs["weight"], "max_rel_grad_diff": max(diffs.values()) / largest,
        "full_seconds": round(full["seconds"], 2), "chunked_seconds": round(chunked["seconds"], 2),
    }
    print(f"loss of {args.tokens} tokens, vocab {args.vocab}, hidden {args.hidden}, {args.dtype} on {args.device}:\n"
          f"  full logits  {report['full_loss_peak_mb']:9.1f} MB  {report['full_seconds']:7.2f} s\n"
          f"  {report['num_chunks']:3d} chunks   {report['chunked_loss_peak_mb']:9.1f} MB  "
          f"{report['chunked_seconds']:7.2f} s  (x{report['ratio']:.3f})\n"
          f"  loss rel diff {report['loss_rel_diff']:.1e}, max abs grad diff {report['max_abs_grad_diff']:.1e}")
    if args.json:
        print(json.dumps(report))


def checkpointing(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        runs = {path: child(args, path, Path(tmp) / f"{path}.pt") for path in MODEL_PATHS}
        grads = {path: torch.load(Path(tmp) / f"{path}.pt") for path in MODEL_PATHS}
    plain, ckpt = grads["plain"], grads["checkpointing"]
    assert plain.keys() == ckpt.keys(), "the two paths trained different weights"
    worst = max(float((ckpt[n] - plain[n]).abs().max() / plain[n].abs().max().clamp_min(1e-30)) for n in plain)
    report = {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens,
              "device": "cpu", "measure": "ru_maxrss - rss before, glibc mmap threshold 64 KiB",
              "plain_peak_mb": round(runs["plain"]["peak_mb"], 1),
              "checkpointing_peak_mb": round(runs["checkpointing"]["peak_mb"], 1),
              "ratio": round(runs["checkpointing"]["peak_mb"] / runs["plain"]["peak_mb"], 4),
              "max_rel_grad_diff": worst, "plain_seconds": round(runs["plain"]["seconds"], 2),
              "checkpointing_seconds": round(runs["checkpointing"]["seconds"], 2)}
    print(f"forward + backward of {args.layers} x {args.hidden} on {args.tokens} tokens: "
          f"{report['plain_peak_mb']:.1f} MB plain, {report['checkpointing_peak_mb']:.1f} MB with checkpointing "
          f"(x{report['ratio']:.3f}); max rel grad diff {worst:.1e}")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
