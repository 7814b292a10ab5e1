"""One rank of tests/e2e/test_preflight_launch.py's over_cap 'sequence_parallel' check (tests/launch.py).

Usage: RANK=R WORLD_SIZE=2 ... python tests/e2e/preflight_groups_worker.py OUT_FOLDER BUDGET

Two CPU ranks on gloo, a group of 2 (``max_sp`` 2): the preflight (:func:`run_preflight`, on a
:class:`LocalBackend` and odb's gloo communicator) at ``max_tokens BUDGET``, with the run's groups
and without them, on the tiny Llama (configs/tiny_model.json; causal attention, which the CPU
runs through SDPA's own kernel) and a tiny Gemma-2 (soft-capping: odb builds the scores). Every
attention call the preflight makes is observed where odb's CPU path computes it
(``grouped_varlen``: its heads and its longest sample, whose scores are ``heads x L x L``). Writes
``rank<R>.json``: per model and case, the largest call's heads and length and the preflight's peak.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's odb, installed or not

from odb.batching.align import TorchCommunicator  # noqa: E402
from odb.batching.config import OdbConfig  # noqa: E402
from odb.training.attention import varlen  # noqa: E402
from odb.training.backends.base import LocalBackend  # noqa: E402
from odb.training.backends.deepspeed import release  # noqa: E402
from odb.training.config.settings import DataSettings, ModelSettings, PreflightSettings, RunConfig  # noqa: E402
from odb.training.model.build import build_model, load_tokenizer  # noqa: E402
from odb.training.run.preflight import run_preflight  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.sequence_parallel import setup_groups  # noqa: E402

GEMMA2 = {"model_type": "gemma2", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "max_position_embeddings": 8192, "sliding_window": 8192, "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}


def main() -> None:
    out, budget = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    comm = TorchCommunicator()
    seen: list[tuple[int, int]] = []  # (heads, longest sample) of every attention call
    grouped = varlen.grouped_varlen

    def observed(q, k, v, cu_seqlens, *args, **kwargs):
        seen.append((q.shape[1], int((cu_seqlens[1:] - cu_seqlens[:-1]).max())))
        return grouped(q, k, v, cu_seqlens, *args, **kwargs)

    varlen.grouped_varlen = observed
    (out / "gemma2.json").write_text(json.dumps(GEMMA2))
    results = {}
    for name, path in (("llama", ROOT / "configs" / "tiny_model.json"), ("gemma2", out / "gemma2.json")):
        model = build_model(path, seed=0, vocab_size=len(tokenizer))
        groups = setup_groups(model, (2,), rank=rank, world_size=world)
        config = RunConfig(model=ModelSettings(path=str(path), tokenizer="data/tokenizer"),
                           data=DataSettings(path="unused"),
                           batching=OdbConfig(max_tokens=budget, over_cap="sequence_parallel", max_sp=2),
                           preflight=PreflightSettings(memory_limit_mb=10**6))
        results[name] = {}
        for case, run_groups in (("groups", groups), ("alone", None)):
            seen.clear()
            report = run_preflight(config, LocalBackend(model), comm, tokenizer=tokenizer, vision=None, packed=True,
                                   world_size=world, log=lambda _: None, groups=run_groups, rank=rank)
            heads, length = max(seen, key=lambda call: call[0] * call[1] ** 2)
            results[name][case] = {"heads": heads, "length": length, "peak_mb": report.peak_mb,
                                   "step_s": report.step_s}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    release()  # (Ulysses started DeepSpeed's collectives: their CPU all-reduce buffer)
    end_process(0)


if __name__ == "__main__":
    main()
