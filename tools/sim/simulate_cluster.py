#!/usr/bin/env python
"""Predict multi-node training throughput of odb against fixed batches and the offline gmt oracle.

    python tools/sim/simulate_cluster.py --trace ../shared/traces/*.txt --nodes 1 2 8 32 128 \\
        --png docs/cluster_sim.png --json
    python tools/sim/simulate_cluster.py --cpu-fit runs/cpu_fixed* --cpu-predict runs/cpu_odb*

The batches are odb's own: every policy (``odb``; the padded baselines ``fixed`` and ``gmt``) is
planned by the real ``OnlineBatcher`` and alignment over one simulated rank per GPU, as
:func:`odb.batching.simulate.simulate` does (:func:`plan`; the unit test checks that the two
agree), so the micro-batch counts, dummies and per-rank loads are odb's. Only the time of each
micro-batch is modelled. The workload is weak scaling: ``--samples-per-gpu`` samples per GPU,
drawn from the trace as seeded shuffled passes (the same per-GPU load at every size). ``fixed``
runs at ``max_tokens // longest sample of the trace`` (the largest batch whose padded batch of the
longest samples fits the budget) and at each ``--fixed-batch`` (8: a common choice, over budget).

Model of time (per optimizer step; every micro-batch position is a ZeRO sync point, so it lasts
as long as the slowest rank's micro-batch there, and the step as long as its positions)::

    step_s = sum_p [ max_r compute(r, p) + comm_micro ] + comm_step + optimizer_s
    compute = 6 N T / R + 6 layers hidden A / R + 6 N_vision P / R + overhead_micro
    R = peak bf16 FLOP/s x MFU (one GPU)

* ``T``: tokens the layers process: the real tokens of a packed odb micro-batch, ``B x longest``
  for a padded one (fixed, gmt); a dummy is one token. ``N``: the parameters a token meets in a
  matmul (the transformer blocks and the LM head; the input embedding is a lookup).
* ``A``: attention area, ``sum L_i^2`` packed (varlen: each sample attends to itself),
  ``B x longest^2`` padded. ``6 layers hidden L^2`` is PaLM's ``12 layers hidden L^2`` (QK^T and
  AV, forward and backward) halved for causal kernels that skip the masked triangle.
* ``P``: vision-encoder patches of the micro-batch (not padded by any policy), ``N_vision``
  the encoder's parameters (``--vision-params``; counted only for traces with patches).
* Communication, ring over ``n`` ranks with bandwidth ``B``: NVLink when all ranks sit in one
  node, the per-GPU inter-node bandwidth once they span nodes: all-reduce ``2 (n-1)/n bytes / B``,
  reduce-scatter and all-gather ``(n-1)/n bytes / B``; bytes = 2 x all parameters (bf16, the
  default ``communication_data_type`` of a bf16 DeepSpeed run), no latency term, no overlap
  with compute (configs/ds_zero2.json sets ``overlap_comm: false``; ``--overlap-comm`` hides the
  per-micro-batch collectives behind the backward, 2/3 of the slowest rank's compute).

  - ZeRO-0: one all-reduce per step. ZeRO-1: one all-reduce at the accumulation boundary plus
    the all-gather of the updated parameters.
  - ZeRO-2: DeepSpeed 0.19.8 reduces the gradients of *every* micro-batch in its backward
    (``engine.allreduce_gradients``: "ZeRO stage >= 2 communicates during non gradient
    accumulation boundaries as well"; ``no_sync`` is refused for stage 2/3; only backward calls
    inside ``engine.coalesce_grad_reduction()`` are reduced once per step, and odb does not use
    it). With the defaults ``reduce_scatter: true`` and ``use_multi_rank_bucket_allreduce: true``
    ``stage_1_and_2.average_tensor`` all-reduces each bucket and every rank keeps its partition:
    one all-reduce per micro-batch, plus the all-gather of the updated parameters per step.
  - ZeRO-3: per micro-batch an all-gather of the parameters for the forward, another for the
    backward, and a reduce-scatter of the gradients; nothing more per step.
* ``optimizer_s``: Adam on this rank's optimizer shard (all parameters at ZeRO-0, 1/n above),
  memory-bound: 30 bytes per parameter (fp32 master, m, v read and written, fp32 gradient read,
  bf16 parameter written) / HBM bandwidth.
* ``round_s``: odb's own rounds, serial with training: each round's decision as this CPU computed
  it for the whole world (measured in the plan), plus its gather, Bruck's over gloo's
  point-to-point (:class:`odb.batching.comm.TorchCommunicator`): ``2 ceil(log2 W)`` messages of
  ``--round-alpha-us`` each and every rank's row at ``--round-beta-gbs`` (the proposals' rows as
  planned; a training run's also carry telemetry, ``tools/bench/bench_round.py``).

``--cpu-fit RUN... --cpu-predict RUN...`` turns the model on this CPU (one process, no
communication). Each group holds repeats of one ``launch/train.py`` run (one configuration; its
summary.json holds the settings). The tool rebuilds each group's plan from the processed lengths
of the same samples and checks it against every run's own steps (tokens and samples per step).
Each step's time is its fastest repeat (the plan is the same in every repeat, so the fastest is
the least disturbed by other work on a shared machine). It fits linear FLOP/s, attention FLOP/s
and a per-micro-batch overhead (optimizer step included at GAS 1) to the FIT group's steps, by
non-negative least squares over every step but the first (warm-up), and predicts the PREDICT
group's steady samples/s; it reports the predicted and measured ratio of the two.

The last line of stdout is one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from odb.batching import align, stream  # noqa: E402
from odb.batching.batcher import OnlineBatcher  # noqa: E402
from odb.batching.config import OdbConfig, load_odb_config  # noqa: E402
from odb.batching.fit import features  # noqa: E402
from odb.batching.plan import MicroBatch
from odb.batching.simulate import SimulatedFeed, SimulationResult, run_ranks, simulate  # noqa: E402
from tools.traces import read_lengths  # noqa: E402

__all__ = ["Cluster", "Model", "fixed_batch_for", "main", "plan", "plan_arrays", "policy_configs", "step_times",
           "workload"]

OPTIMIZER_BYTES_PER_PARAM = 30
"""Adam, memory-bound: fp32 master, m and v read and written (24), fp32 gradient read (4), bf16 param written (2)."""


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer (Llama layout: grouped-query attention, gated MLP)."""

    name: str
    layers: int
    hidden: int
    ffn: int
    vocab: int
    kv_hidden: int
    tied: bool
    vision_params: float = 0.0

    @property
    def compute_params(self) -> int:
        """Parameters a token meets in a matmul: q, o (h x h), k, v (h x kv), the gated MLP
        (3 h x ffn) per layer, and the LM head (the embedding is a lookup)."""
        block = 2 * self.hidden ** 2 + 2 * self.hidden * self.kv_hidden + 3 * self.hidden * self.ffn
        return self.layers * block + self.vocab * self.hidden

    @property
    def params(self) -> float:
        """Every trained parameter (what the gradient collectives carry); norms left out."""
        return self.compute_params + (0 if self.tied else self.vocab * self.hidden) + self.vision_params

    def flops(self, tokens, area, patches):
        """Forward + backward FLOPs of micro-batches (arrays or numbers): linear, attention, vision."""
        return (6.0 * self.compute_params * tokens, 6.0 * self.layers * self.hidden * area,
                6.0 * self.vision_params * patches)


LLAMA2_7B = Model("llama-2-7b", layers=32, hidden=4096, ffn=11008, vocab=32000, kv_hidden=4096, tied=False)


def load_model(spec: str, vision_params: float = 0.0) -> Model:
    """``7b`` (Llama-2-7B) or a Hugging Face ``config.json`` of a Llama-style model."""
    if spec == "7b":
        return dataclasses.replace(LLAMA2_7B, vision_params=vision_params)
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"error: --model {spec!r} is neither '7b' nor a model config.json")
    c = json.loads(path.read_text())
    heads = c["num_attention_heads"]
    return Model(path.stem, layers=c["num_hidden_layers"], hidden=c["hidden_size"], ffn=c["intermediate_size"],
                 vocab=c["vocab_size"], kv_hidden=c["hidden_size"] * c.get("num_key_value_heads", heads) // heads,
                 tied=bool(c.get("tie_word_embeddings", False)), vision_params=vision_params)


@dataclass(frozen=True)
class Cluster:
    """Data-parallel ranks, their speed and their links (one rank per GPU)."""

    nodes: int = 1
    gpus_per_node: int = 8
    flops_per_s: float = 989e12 * 0.4
    attn_flops_per_s: float = 989e12 * 0.4
    intra_gbs: float = 450.0
    inter_gbs: float = 50.0
    zero: int = 2
    hbm_gbs: float = 3350.0
    micro_overhead_s: float = 0.0
    overlap_comm: bool = False
    round_alpha_us: float = 30.0  # odb's round: one message's latency over TCP (gloo)
    round_beta_gbs: float = 5.0  # ... and one TCP stream's bandwidth

    def round_s(self, decision_s: np.ndarray, received: np.ndarray) -> float:
        """odb's rounds: each rank's decision (measured) and the gather (Bruck over gloo's
        point-to-point: ``2 ceil(log2 W)`` messages, then the bytes received)."""
        if not len(decision_s):
            return 0.0
        hops = 2 * math.ceil(math.log2(self.world)) if self.world > 1 else 0
        gather = hops * self.round_alpha_us * 1e-6 + received / (self.round_beta_gbs * 1e9)
        return float((decision_s + gather).sum())

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def ring_s(self, num_bytes: float, passes: int) -> float:
        """``passes`` = 1 for reduce-scatter / all-gather, 2 for all-reduce."""
        n = self.world
        if n == 1:
            return 0.0
        bandwidth = (self.intra_gbs if self.nodes == 1 else self.inter_gbs) * 1e9
        return passes * (n - 1) / n * num_bytes / bandwidth

    def comm_s(self, model: Model) -> tuple[float, float]:
        """Seconds of collectives per micro-batch and per step (see the module docstring)."""
        size = 2.0 * model.params  # bf16
        if self.zero == 0:
            return 0.0, self.ring_s(size, 2)
        if self.zero == 1:
            return 0.0, self.ring_s(size, 2) + self.ring_s(size, 1)
        if self.zero == 2:
            return self.ring_s(size, 2), self.ring_s(size, 1)
        return 3 * self.ring_s(size, 1), 0.0

    def optimizer_s(self, model: Model) -> float:
        shard = model.params / (self.world if self.zero >= 1 else 1)
        return OPTIMIZER_BYTES_PER_PARAM * shard / (self.hbm_gbs * 1e9)


def read_trace(path: str | Path) -> list[tuple[int, int]]:
    """One sample per line: ``tokens [vision_patches]`` (tools/bench/bench_batching.py's reader), at least one."""
    trace = read_lengths(str(path))
    if not trace:
        raise SystemExit(f"{path} holds no sample")
    return trace


def workload(trace: list[tuple[int, int]], num_samples: int, seed: int) -> list[tuple[int, int]]:
    """``num_samples`` samples: seeded shuffled passes over the trace, as many as it takes."""
    rng = np.random.default_rng(seed)
    passes = math.ceil(num_samples / len(trace))
    order = np.concatenate([rng.permutation(len(trace)) for _ in range(passes)])[:num_samples]
    return [trace[i] for i in order.tolist()]


def fixed_batch_for(trace: list[tuple[int, int]], max_tokens: int) -> int:
    """The batch size a user picks so that a padded batch of the longest samples fits the budget."""
    return max(1, max_tokens // min(max(t for t, _ in trace), max_tokens))


def policy_configs(base: OdbConfig, fixed_batches: list[int]) -> dict[str, OdbConfig]:
    """odb as configured, the gmt oracle and one fixed baseline per batch size (static shards,
    as tools/bench/bench_batching.py runs the baselines)."""
    configs = {"odb": base, "gmt": dataclasses.replace(base, policy="gmt", sharding="static")}
    for batch in sorted(set(fixed_batches)):
        configs[f"fixed_b{batch}"] = dataclasses.replace(base, policy="fixed", sharding="static", batch_size=batch,
                                                         window=max(base.window, batch))
    return configs


def _micro_figures(mb: MicroBatch) -> tuple[int, int, int, int, int, int, int]:
    """Tokens processed, attention area, patches, real tokens, samples, is-dummy of one micro-batch,
    and the ranks it is shared by (1: its own). A rank's slice of a shared long sample (``T``
    tokens over ``d`` ranks): ``T / d`` tokens and ``T**2 / d`` of attention (its heads over the
    whole sample); its real tokens and sample count at the owner."""
    if mb.shared is not None:  # (its figures as the cost fit sees them)
        tokens, area, patches, _ = features(mb)
        return tokens, area, patches, mb.tokens, len(mb.samples), 0, mb.shared.degree
    lengths = [s.tokens for s in mb.samples] or [1]  # a dummy: one token
    if mb.padded:
        tokens, area = len(lengths) * max(lengths), len(lengths) * max(lengths) ** 2
    else:
        tokens, area = sum(lengths), sum(t * t for t in lengths)
    return tokens, area, sum(s.patches for s in mb.samples), mb.tokens, len(mb.samples), int(mb.is_dummy), 1


def _arrays(per_rank: list[tuple[list[int], list[tuple]]]) -> dict[str, np.ndarray | int]:
    gas = per_rank[0][0]
    assert all(g == gas for g, _ in per_rank), "ranks disagree on the step structure"
    figures = np.array([rows for _, rows in per_rank], dtype=np.float64).reshape(len(per_rank), sum(gas), 7)
    figures = figures.transpose(1, 0, 2)  # [positions, ranks, figure]
    return {"tokens": figures[..., 0], "area": figures[..., 1], "patches": figures[..., 2], "gas": np.array(gas),
            "real": int(figures[..., 3].sum()), "materialized": int(figures[..., 0].sum() - figures[..., 5].sum()),
            "samples": int(figures[..., 4].sum()), "dummies": int(figures[..., 5].sum()), "degree": figures[..., 6]}


def plan_arrays(result: SimulationResult) -> dict[str, np.ndarray | int]:
    """Per micro-batch position (all steps in order) and rank: tokens processed, attention area
    and patches; the micro-batches of each step; what was trained."""
    return _arrays([([len(s.micro_batches) for s in steps], [_micro_figures(m) for s in steps for m in s.micro_batches])
                    for steps in result.steps])


@contextmanager
def _shared_across_ranks(decision_s: list[float]) -> Iterator[None]:
    """Work that every simulated rank repeats identically, done once for all of them.

    * ``decide``: every rank decides the round from the same gathered matrix, a pure function of
      it (docs/design.md, I3); 1024 ranks would compute one decision 1024 times, O(world^2) per round.
      The first rank's :class:`~odb.batching.plan.Decision` is handed to the others (keyed by every
      argument, the round's index among them, and the ranks' bin counts and window costs); its CPU
      seconds go to ``decision_s``.
    * ``epoch_order``: each rank caches the epoch's permutation of the whole dataset (16 MB at 2M
      samples, times 1024 ranks); here they share one read-only array.

    The unit test checks the resulting plans against odb's own :func:`~odb.batching.simulate.simulate`.
    """
    decide, epoch_order = align.decide, stream.epoch_order
    last: list = [None, None]  # key, decision

    def shared_decide(fields, **kwargs):
        key = (sorted(kwargs.items()), fields["num_bins"].tobytes(), fields["window_cost"].tobytes())
        if key != last[0]:
            start = time.process_time()
            last[:] = [key, decide(fields, **kwargs)]
            decision_s.append(time.process_time() - start)  # (one rank's decision at this world size)
        return last[1]

    @functools.cache
    def shared_order(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
        order = epoch_order(seed, epoch, dataset_size)
        order.flags.writeable = False
        return order

    align.decide, stream.epoch_order = shared_decide, shared_order
    try:
        yield
    finally:
        align.decide, stream.epoch_order = decide, epoch_order


def plan(config: OdbConfig, lengths: list[tuple[int, int]], world: int) -> dict[str, np.ndarray | int]:
    """:func:`plan_arrays` of :func:`odb.batching.simulate.simulate`, each step reduced to its
    figures as soon as it is planned: the same batcher and alignment, in memory that grows with
    the micro-batches rather than with every step's ``world x GAS`` cost table on every rank."""
    per_rank: list = [None] * world

    received: list[int] = []  # per gather of rows (the settings check, then each round): what one rank receives

    def rank_main(comm) -> None:
        if comm.rank == 0:
            comm = _Receiving(comm, received)
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths))
        if batcher.packer.is_offline:
            # gmt sizes its round vector for the whole dataset (world x 4 x N int64 gathered: 17 GB
            # at 1024 ranks x 512k samples); a static shard holds at most ceil(N / world) samples, and
            # the plan does not depend on the vector's unused room (the test compares with simulate()).
            batcher.capacity = min(batcher.capacity, -(-len(lengths) // world))
        gas, rows = [], []
        for step in batcher:
            gas.append(len(step.micro_batches))
            rows += [_micro_figures(m) for m in step.micro_batches]
        per_rank[comm.rank] = (gas, rows, batcher.round_index)

    decision_s: list[float] = []  # per round, its decision's CPU seconds (computed once for all ranks)
    with _shared_across_ranks(decision_s):
        run_ranks(world, rank_main, timeout_s=3600.0)
    rounds = per_rank[0][2]
    return {**_arrays([p[:2] for p in per_rank]), "round_decision_s": np.array(decision_s[-rounds:] if rounds else []),
            "round_received": 8.0 * np.array(received[-rounds:] if rounds else [])}  # (the rounds')


class _Receiving:
    """Rank 0's communicator, counting the values every round gathers (what each rank receives)."""

    def __init__(self, comm, received: list[int]) -> None:
        self.comm, self.received = comm, received
        self.rank, self.world_size = comm.rank, comm.world_size

    @property
    def num_collectives(self) -> int:
        return self.comm.num_collectives

    def all_gather_v(self, values):
        rows, lengths = self.comm.all_gather_v(values)
        self.received.append(int(lengths.sum()))
        return rows, lengths

    def all_gather(self, values):  # (fixed-length gathers: no round's)
        return self.comm.all_gather(values)


def micro_seconds(arrays: dict, model: Model, cluster: Cluster) -> np.ndarray:
    """Compute seconds of every micro-batch, ``[positions, ranks]``."""
    linear, attention, vision = model.flops(arrays["tokens"], arrays["area"], arrays["patches"])
    return (linear + vision) / cluster.flops_per_s + attention / cluster.attn_flops_per_s + cluster.micro_overhead_s


def step_times(arrays: dict, model: Model, cluster: Cluster) -> dict[str, float]:
    """Seconds of the whole plan, and where they go."""
    compute = micro_seconds(arrays, model, cluster)
    slowest = compute.max(axis=1)
    comm_micro, comm_step = cluster.comm_s(model)
    positions, num_steps = compute.shape[0], len(arrays["gas"])
    mean = compute.mean(axis=1)
    if cluster.overlap_comm:  # collectives in flight during the backward (2/3 of the FLOPs)
        exposed = float(np.maximum(comm_micro - 2 / 3 * slowest, 0).sum())
    else:
        exposed = positions * comm_micro
    parts = {"compute_s": float(mean.sum()), "straggler_s": float((slowest - mean).sum()),
             "comm_s": exposed + num_steps * comm_step,
             "optimizer_s": num_steps * cluster.optimizer_s(model),
             "round_s": cluster.round_s(arrays.get("round_decision_s", np.zeros(0)),
                                        arrays.get("round_received", np.zeros(0)))}
    return {"seconds": sum(parts.values()), **parts}


def simulate_policy(config: OdbConfig, lengths: list[tuple[int, int]], model: Model, cluster: Cluster) -> dict:
    arrays = plan(config, lengths, cluster.world)
    times = step_times(arrays, model, cluster)
    seconds = times["seconds"]
    return {"steps": len(arrays["gas"]), "micro_batch_positions": int(arrays["tokens"].shape[0]),
            "micro_batches": int(arrays["tokens"].size - arrays["dummies"]), "dummy_micro_batches": arrays["dummies"],
            "samples": arrays["samples"], "padding_ratio": round(1 - arrays["real"] / arrays["materialized"], 4),
            "largest_micro_batch_tokens": int(arrays["tokens"].max()),
            **{k: round(v, 4) for k, v in times.items()},
            "samples_per_s": round(arrays["samples"] / seconds, 3), "tokens_per_s": round(arrays["real"] / seconds, 1)}


def simulate_trace(name: str, trace: list[tuple[int, int]], args: argparse.Namespace, base: OdbConfig,
                   cluster: Cluster, model: Model) -> list[dict]:
    """Every policy at every node count on one trace."""
    has_patches = any(p for _, p in trace)
    model = model if has_patches else dataclasses.replace(model, vision_params=0.0)
    auto = fixed_batch_for(trace, base.max_tokens)
    configs = policy_configs(base, [auto, *args.fixed_batch])
    rows = []
    for nodes in args.nodes:
        sized = dataclasses.replace(cluster, nodes=nodes)
        lengths = workload(trace, args.samples_per_gpu * sized.world, args.seed)
        policies = {key: simulate_policy(config, lengths, model, sized) for key, config in configs.items()}
        odb = policies["odb"]["samples_per_s"]
        speedups = {f"odb/{key}": round(odb / p["samples_per_s"], 4) for key, p in policies.items() if key != "odb"}
        rows.append({"trace": name, "nodes": nodes, "gpus": sized.world, "samples": len(lengths),
                     "fixed_auto_batch": auto, "policies": policies, "speedup": speedups})
        print(f"simulated {name} on {nodes} node(s)", file=sys.stderr, flush=True)
    return rows


# ---- output -------------------------------------------------------------------------------------

def markdown(rows: list[dict], fixed_batches: list[int]) -> str:
    extra = sorted(set(fixed_batches))
    head = (["trace", "nodes x GPUs", "odb samples/s", "fixed (b = budget / longest)"] +
            [f"fixed b={b}" for b in extra] + ["gmt", "odb / fixed (b = budget / longest)"] +
            [f"odb / fixed b={b}" for b in extra] + ["odb / gmt", "odb comm share", "odb straggler share"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        p, s, auto = row["policies"], row["speedup"], f"fixed_b{row['fixed_auto_batch']}"
        odb = p["odb"]
        cells = ([row["trace"], f"{row['nodes']} x {row['gpus'] // row['nodes']}", f"{odb['samples_per_s']:.1f}",
                  f"{p[auto]['samples_per_s']:.1f} (b={row['fixed_auto_batch']})"] +
                 [f"{p[f'fixed_b{b}']['samples_per_s']:.1f}" for b in extra] + [f"{p['gmt']['samples_per_s']:.1f}",
                 f"{s['odb/' + auto]:.2f}x"] + [f"{s[f'odb/fixed_b{b}']:.2f}x" for b in extra] +
                 [f"{s['odb/gmt']:.2f}x", f"{odb['comm_s'] / odb['seconds']:.2f}",
                  f"{odb['straggler_s'] / odb['seconds']:.2f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], fixed_batches: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    panels = [("auto", "odb / fixed (b = budget / longest)")] + \
        [(f"fixed_b{b}", f"odb / fixed (b = {b})") for b in sorted(set(fixed_batches))] + [("gmt", "odb / gmt")]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), dpi=80, squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for trace in dict.fromkeys(row["trace"] for row in rows):
            mine = [row for row in rows if row["trace"] == trace]
            keys = [f"odb/fixed_b{row['fixed_auto_batch']}" if key == "auto" else f"odb/{key}" for row in mine]
            ax.plot([row["nodes"] for row in mine], [row["speedup"][k] for row, k in zip(mine, keys)], "o-",
                    label=trace)
        ax.set_xscale("log", base=2)
        nodes = sorted({row["nodes"] for row in rows})
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.minorticks_off()
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("nodes")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("predicted speedup (samples/s)")
    axes[0][0].legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


# ---- the CPU check ------------------------------------------------------------------------------

def _run(folder: Path) -> tuple[dict, list[dict]]:
    summary, metrics = folder / "summary.json", folder / "metrics.jsonl"
    if not summary.is_file() or not metrics.is_file():
        raise SystemExit(f"error: {folder} has no summary.json and metrics.jsonl: pass launch/train.py "
                         "--output_dir folders")
    summary = json.loads(summary.read_text())
    if summary["world_size"] != 1:
        raise SystemExit(f"error: --cpu-fit/--cpu-predict take one-process runs; {folder} ran "
                         f"{summary['world_size']} ranks")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return summary, [row for row in rows if "eval_loss" not in row]


def data_lengths(config: dict) -> list[tuple[int, int]]:
    """``(tokens, patches)`` of every training sample of a text run, processed as the trainer does."""
    from odb.data.processing import DataConfig, SampleDataset, sample_sizes
    from odb.training.model.build import load_tokenizer

    data, batching = config["data"], config["batching"]
    if data["val_ratio"] or json.loads(Path(config["model"]["path"]).read_text()).get("vision_config"):
        raise SystemExit("error: the CPU check takes text runs without --val_ratio")
    tokenizer = load_tokenizer(config["model"]["tokenizer"])
    dataset = SampleDataset(data["path"], tokenizer, DataConfig(**data["processing"]), seed=batching["seed"],
                            max_samples=data["max_samples"],
                            truncate_to=batching["max_tokens"] if batching["over_cap"] == "truncate" else None)
    out = []
    for uid in range(len(dataset)):
        sizes = sample_sizes(dataset[uid])
        out.append((sizes.tokens, sizes.patches))
    return out


def _nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every subset of columns (there are three)."""
    best, best_error = np.zeros(features.shape[1]), float(np.sum(target ** 2))
    for size in range(1, features.shape[1] + 1):
        for subset in itertools.combinations(range(features.shape[1]), size):
            coef, *_ = np.linalg.lstsq(features[:, subset], target, rcond=None)
            error = float(np.sum((features[:, subset] @ coef - target) ** 2))
            if np.all(coef >= 0) and error < best_error:
                best, best_error = np.zeros(features.shape[1]), error
                best[list(subset)] = coef
    return best


def _step_features(arrays: dict, model: Model) -> np.ndarray:
    """Per step (one rank): linear+vision FLOPs, attention FLOPs, micro-batches; tokens processed."""
    linear, attention, vision = model.flops(arrays["tokens"][:, 0], arrays["area"][:, 0], arrays["patches"][:, 0])
    ends = np.cumsum(arrays["gas"])
    return np.array([[(linear + vision)[a:b].sum(), attention[a:b].sum(), b - a, arrays["tokens"][a:b, 0].sum()]
                     for a, b in zip(ends - arrays["gas"], ends)])


def _measured_group(role: str, runs: list[tuple[dict, list[dict]]], lengths: list[tuple[int, int]],
                    model: Model) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """The plan of one group of runs (same settings), checked against each run's own steps."""
    batching = {json.dumps(summary["config"]["batching"], sort_keys=True) for summary, _ in runs}
    if len(batching) != 1:
        raise SystemExit(f"error: the {role} runs differ in their odb settings; pass repeats of one configuration")
    config = OdbConfig(**runs[0][0]["config"]["batching"])
    result = simulate(config, lengths, 1)
    features = _step_features(plan_arrays(result), model)
    samples = np.array([step.num_samples for step in result.steps[0]])
    matching = [sum(int(r["materialized_tokens"]) == int(t) and r["samples"] == n
                    for r, t, n in zip(rows, features[:, 3], samples)) for _, rows in runs]
    # The plan is the same in every repeat, so each step's fastest repeat is the one least disturbed
    # by other work on the machine.
    step_s = np.array([[r["step_s"] for r in rows] for _, rows in runs]).min(axis=0)
    report = {"runs": [str(s["config"]["run"]["output_dir"]) for s, _ in runs], "policy": config.policy,
              "simulated_steps": len(samples), "run_steps": [len(rows) for _, rows in runs],
              "steps_matching": matching,
              "measured_samples_per_s_wall": [s["samples_per_s"] for s, _ in runs],
              "measured_samples_per_s_steady": round(samples[1:].sum() / step_s[1:].sum(), 3)}
    return report, features, samples, step_s


def cpu_check(fit_dirs: list[Path], predict_dirs: list[Path]) -> dict:
    """Fits the CPU to the ``fit`` runs' step times, predicts the ``predict`` runs (module docstring)."""
    groups = {"fit": [_run(d) for d in fit_dirs], "predict": [_run(d) for d in predict_dirs]}
    config = groups["fit"][0][0]["config"]
    for summary, _ in groups["fit"] + groups["predict"]:
        if any(summary["config"][key] != config[key] for key in ("data", "model")):
            raise SystemExit("error: the runs differ in their data or model settings; train all on the same samples")
    lengths = data_lengths(config)
    model = load_model(config["model"]["path"])
    report: dict = {"model": dataclasses.asdict(model), "compute_params": model.compute_params, "samples": len(lengths)}
    features, samples, step_s = {}, {}, {}
    for role, runs in groups.items():
        report[role], features[role], samples[role], step_s[role] = _measured_group(role, runs, lengths, model)
    # One equation per step but the first (it warms up: allocations, first kernels).
    inverse = _nnls(features["fit"][1:, :3], step_s["fit"][1:])
    report["fit"].update(linear_flops_per_s=1 / inverse[0] if inverse[0] else None,
                         attn_flops_per_s=1 / inverse[1] if inverse[1] else None, micro_overhead_s=float(inverse[2]))
    for role in groups:
        seconds = features[role][:, :3] @ inverse
        report[role]["predicted_samples_per_s_steady"] = round(samples[role][1:].sum() / seconds[1:].sum(), 3)
    fit, predict = report["fit"], report["predict"]
    predicted = predict["predicted_samples_per_s_steady"] / fit["predicted_samples_per_s_steady"]
    steady = predict["measured_samples_per_s_steady"] / fit["measured_samples_per_s_steady"]
    wall = float(np.median(predict["measured_samples_per_s_wall"]) / np.median(fit["measured_samples_per_s_wall"]))
    report["ratio"] = {"predicted": round(predicted, 4), "measured_steady": round(steady, 4),
                       "measured_wall_median": round(wall, 4), "error": round(predicted / steady - 1, 4),
                       "error_wall": round(predicted / wall - 1, 4)}
    return report


def _rate(flops_per_s: float | None) -> str:
    return f"{flops_per_s / 1e9:.2f} GFLOP/s" if flops_per_s else "not fitted (0)"


def cpu_markdown(report: dict) -> str:
    fit = report["fit"]
    lines = ["| role | runs | policy | steps simulated / run (equal tokens and samples) | measured samples/s "
             "(wall, each run) | measured samples/s (steady, fastest repeat per step) | predicted samples/s (steady) |",
             "|---|---|---|---|---|---|---|"]
    for role in ("fit", "predict"):
        r = report[role]
        steps = ", ".join(f"{r['simulated_steps']} / {n} ({m})" for n, m in zip(r["run_steps"], r["steps_matching"]))
        lines.append(f"| {role} | {', '.join(r['runs'])} | {r['policy']} | {steps} | "
                     f"{', '.join(f'{v:.2f}' for v in r['measured_samples_per_s_wall'])} | "
                     f"{r['measured_samples_per_s_steady']:.2f} | {r['predicted_samples_per_s_steady']:.2f} |")
    ratio = report["ratio"]
    lines += ["", f"fitted: linear {_rate(fit['linear_flops_per_s'])}, attention {_rate(fit['attn_flops_per_s'])}, "
              f"{fit['micro_overhead_s'] * 1e3:.1f} ms per micro-batch",
              f"{report['predict']['policy']} / {fit['policy']}: predicted {ratio['predicted']:.3f}, measured "
              f"{ratio['measured_steady']:.3f} steady (error {ratio['error'] * 100:+.1f}%), "
              f"{ratio['measured_wall_median']:.3f} wall (error {ratio['error_wall'] * 100:+.1f}%)"]
    return "\n".join(lines)


# ---- entry point --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", nargs="+", help="length traces: one 'tokens [vision_patches]' line per sample")
    p.add_argument("--cpu-fit", nargs="+", type=Path, metavar="RUN",
                   help="CPU check: launch/train.py --output_dir folders (repeats of one configuration) to fit")
    p.add_argument("--cpu-predict", nargs="+", type=Path, metavar="RUN", help="CPU check: the runs to predict")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of one GPU (H100 SXM)")
    p.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak reached by the model's kernels")
    p.add_argument("--intra-gbs", type=float, default=450.0, help="GB/s per GPU inside a node (NVLink)")
    p.add_argument("--inter-gbs", type=float, default=50.0, help="GB/s per GPU between nodes (400 Gb/s)")
    p.add_argument("--hbm-gbs", type=float, default=3350.0, help="GPU memory GB/s (the optimizer step)")
    p.add_argument("--micro-overhead-ms", type=float, default=0.0,
                   help="fixed time of every micro-batch (kernel launches, Python), dummies included")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--round-alpha-us", type=float, default=30.0,
                   help="odb's round: one message's latency on its gloo group (TCP)")
    p.add_argument("--round-beta-gbs", type=float, default=5.0, help="odb's round: one TCP stream's GB/s")
    p.add_argument("--overlap-comm", action="store_true",
                   help="per-micro-batch collectives overlap the backward (DeepSpeed overlap_comm)")
    p.add_argument("--model", default="7b", help="'7b' (Llama-2-7B) or a Llama-style config.json")
    p.add_argument("--vision-params", type=float, default=0.675e9,
                   help="vision-encoder parameters, counted on traces with patches (Qwen2-VL-7B's ViT)")
    p.add_argument("--odb-config", default=str(ROOT / "configs" / "odb.json"), help="odb's settings (GAS, ...)")
    p.add_argument("--max-tokens", type=int, default=16384, help="token budget per micro-batch")
    p.add_argument("--window", type=int, default=1024, help="odb's window (samples per rank)")
    p.add_argument("--fixed-batch", type=int, nargs="*", default=[8],
                   help="fixed batch sizes to compare besides max_tokens // longest sample")
    p.add_argument("--samples-per-gpu", type=int, default=1000, help="the per-GPU load (weak scaling)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", type=Path, default=None, help="plot the speedups here")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    if bool(args.trace) == bool(args.cpu_fit) or bool(args.cpu_fit) != bool(args.cpu_predict):
        p.error("pass --trace (cluster prediction) or --cpu-fit RUN... --cpu-predict RUN... (the CPU check)")
    if min(args.nodes) < 1 or args.gpus_per_node < 1 or args.samples_per_gpu < 1 or not 0 < args.mfu <= 1:
        p.error("--nodes, --gpus-per-node, --samples-per-gpu must be >= 1 and --mfu in (0, 1]")
    if any(b < 1 for b in args.fixed_batch):
        p.error("--fixed-batch sizes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.cpu_fit:
        report = cpu_check(args.cpu_fit, args.cpu_predict)
        print(cpu_markdown(report))
    else:
        try:
            base = load_odb_config(args.odb_config, max_tokens=args.max_tokens, window=args.window, seed=args.seed)
        except ValueError as err:
            raise SystemExit(f"error: {err}")
        rate = args.tflops * 1e12 * args.mfu
        cluster = Cluster(gpus_per_node=args.gpus_per_node, flops_per_s=rate, attn_flops_per_s=rate,
                          intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs, zero=args.zero, hbm_gbs=args.hbm_gbs,
                          round_alpha_us=args.round_alpha_us, round_beta_gbs=args.round_beta_gbs,
                          micro_overhead_s=args.micro_overhead_ms / 1e3, overlap_comm=args.overlap_comm)
        model = load_model(args.model, args.vision_params)
        rows = []
        for path in args.trace:
            rows += simulate_trace(Path(path).stem, read_trace(path), args, base, cluster, model)
        settings = {"model": {**dataclasses.asdict(model), "compute_params": model.compute_params,
                              "params": model.params},
                    "cluster": {k: v for k, v in dataclasses.asdict(cluster).items() if k != "nodes"},
                    "odb": base.to_dict(), "samples_per_gpu": args.samples_per_gpu, "fixed_batch": args.fixed_batch}
        table = markdown(rows, args.fixed_batch)
        print(table)
        if args.png:
            plot(rows, args.fixed_batch, args.png, f"{model.name}, ZeRO-{args.zero}, {args.gpus_per_node} GPUs/node, "
                 f"{args.tflops:g} TFLOP/s x MFU {args.mfu:g}, {args.inter_gbs:g} GB/s between nodes, "
                 f"max_tokens {base.max_tokens}, {args.samples_per_gpu} samples/GPU")
        report = {"settings": settings, "results": rows}
    report["wall_s"] = round(time.perf_counter() - start, 2)
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
