#!/usr/bin/env python
"""odb's packed rows against padded rows on the CPU, compute alone: the micro-batches that odb and
gmt formed in a tools/bench/bench_train.py run, through the same model, forward and backward.

    python tools/bench/bench_train.py --trace ../shared/traces/llava_like.txt --length_scale 8 --samples 300 \\
        --max_tokens 2048 --systems gmt,odb --keep runs/llava_1rank
    python tools/bench/bench_packed_cpu.py runs/llava_1rank --threads 2 --reps 5

What it times, in one process (no data loading, planning, optimizer or DeepSpeed), every
``--reps`` times in turn, keeping each one's fastest:

* ``model``: the run's initial model (configs/tiny_model.json) over every micro-batch, forward
  and backward, each system's own way: odb's packed rows (one row per micro-batch, ``position_ids``
  restarting per sample, ``cu_seq_lens_q``) through ``odb_varlen``; gmt's padded rows (an
  ``attention_mask``) through transformers' SDPA. The model's own loss on both.
* ``attention``: the attention alone over the same rows (queries, keys and values of the model's
  shapes, random): odb_varlen's packed path against one SDPA call with the padded rows' mask.

Prints one line per figure and, with ``--json``, one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def micro_batches(run: Path, system: str) -> list[list[int]]:
    return [json.loads(line)["ids"] for line in (run / system / "emitted_ids.rank0.jsonl").read_text().splitlines()]


def packed(ids: list[int], samples: dict) -> dict:
    lengths = [len(samples[i]["input_ids"]) for i in ids]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.cat([samples[i]["input_ids"] for i in ids])[None],
            "labels": torch.cat([samples[i]["labels"] for i in ids])[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}


def padded(ids: list[int], samples: dict) -> dict:
    longest = max(len(samples[i]["input_ids"]) for i in ids)
    input_ids = torch.zeros(len(ids), longest, dtype=torch.long)
    mask, labels = torch.zeros_like(input_ids), torch.full_like(input_ids, -100)
    for row, i in enumerate(ids):
        n = len(samples[i]["input_ids"])
        input_ids[row, :n], mask[row, :n], labels[row, :n] = samples[i]["input_ids"], 1, samples[i]["labels"]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def model_passes(model, batches: list[dict]):
    def run() -> None:
        for batch in batches:
            model(**batch).loss.backward()
    return run


def attention_passes(lengths: list[list[int]], *, packed_rows: bool, heads: int, kv_heads: int, dim: int):
    """Attention alone, forward and backward, over rows of these sample lengths."""
    from odb.training import attention

    class Layer:
        is_causal = True

    calls = []
    for row in lengths:
        batch, longest = (1, sum(row)) if packed_rows else (len(row), max(row))
        q, k, v = (torch.randn(batch, longest, h, dim).transpose(1, 2).requires_grad_()  # [B, H, T, D] as projected
                   for h in (heads, kv_heads, kv_heads))
        if packed_rows:
            cu = torch.tensor([0, *torch.tensor(row).cumsum(0).tolist()], dtype=torch.int32)
            calls.append(lambda q=q, k=k, v=v, cu=cu: attention.varlen_attention(
                Layer(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0].sum().backward())
        else:
            real = torch.arange(longest)[None, :] < torch.tensor(row)[:, None]
            mask = torch.ones(longest, longest, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
            calls.append(lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).contiguous().sum().backward())

    def run() -> None:
        for call in calls:
            call()
    return run


def fastest(runs: dict, reps: int) -> dict[str, float]:
    """Each run's fastest of ``reps``, the runs taking turns (a slow spell of the machine hits all)."""
    for run in runs.values():
        run()  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(reps):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a tools/bench/bench_train.py --keep folder with gmt and odb runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    from odb.training import attention

    torch.set_num_threads(args.threads)
    attention.register()
    samples = {s["id"]: s for s in torch.load(args.run / "samples.pt")}
    config = AutoConfig.from_pretrained(ROOT / "configs" / "tiny_model.json")
    models = {}
    for name, attn in (("odb", attention.ATTN_IMPLEMENTATION), ("gmt", "sdpa")):
        torch.manual_seed(0)  # (a config of its own each: from_config sets the attention on it)
        models[name] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn)
        models[name].config.use_cache = False
    odb_ids, gmt_ids = micro_batches(args.run, "odb"), micro_batches(args.run, "gmt")
    shapes = {"heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
              "dim": config.hidden_size // config.num_attention_heads}
    lengths = {name: [[len(samples[i]["input_ids"]) for i in ids] for ids in batches]
               for name, batches in (("odb", odb_ids), ("gmt", gmt_ids))}
    model = fastest({"odb": model_passes(models["odb"], [packed(ids, samples) for ids in odb_ids]),
                     "gmt": model_passes(models["gmt"], [padded(ids, samples) for ids in gmt_ids])}, args.reps)
    attn = fastest({"odb": attention_passes(lengths["odb"], packed_rows=True, **shapes),
                    "gmt": attention_passes(lengths["gmt"], packed_rows=False, **shapes)}, args.reps)
    result = {
        "threads": args.threads, "reps": args.reps, "samples": sum(map(len, odb_ids)),
        "real_tokens": sum(map(sum, lengths["odb"])), "gmt_padded_tokens": sum(len(r) * max(r) for r in lengths["gmt"]),
        "micro_batches": {"odb": len(odb_ids), "gmt": len(gmt_ids)},
        "model_s": {k: round(v, 3) for k, v in model.items()}, "attention_s": {k: round(v, 4) for k, v in attn.items()},
        "odb_over_gmt": {"model": round(model["odb"] / model["gmt"], 3),
                         "attention": round(attn["odb"] / attn["gmt"], 3)},
    }
    print(f"model forward+backward: odb packed {model['odb']:.3f} s, gmt padded {model['gmt']:.3f} s "
          f"(odb / gmt {result['odb_over_gmt']['model']:.3f}); attention alone: odb {attn['odb'] * 1e3:.0f} ms, "
          f"gmt {attn['gmt'] * 1e3:.0f} ms ({result['odb_over_gmt']['attention']:.3f}); "
          f"{result['real_tokens']} real tokens, gmt pads to {result['gmt_padded_tokens']}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
