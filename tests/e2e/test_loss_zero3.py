"""The chunked loss under ZeRO-3 on two CPU ranks (tests/e2e/loss_zero3_worker.py, one launch).

Every parameter is partitioned, so each call of the LM head is a collective gather: ranks whose
micro-batches score different numbers of tokens (and a dummy on one) must still call the head
equally often, or the launch hangs (and times out here). The oracle is the model's own loss on
each sample alone, in one plain process with the model's own eager attention: the step's gradient
(chunked, and full logits), gathered before the optimizer step, must agree with the oracle's to
1e-5 (relative to each parameter's largest entry), and each rank's loss sum to 1e-6.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launch import deepspeed

WORKER = Path(__file__).resolve().parent / "loss_zero3_worker.py"


@pytest.mark.e2e
def test_chunked_and_full_loss_gradients_equal_the_models_own_at_zero3_on_two_ranks(tmp_path):
    start = time.monotonic()
    deepspeed([str(tmp_path)], timeout=420, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"launch took {time.monotonic() - start:.0f} s")
    for name, result in ranks[0].items():
        for rank, values in enumerate(ranks):
            losses = values[name]["losses"]
            print(f"{name} rank {rank}: loss sum full {losses['full']:.6f}, chunked {losses['chunked']:.6f}, "
                  f"own {losses['oracle']:.6f}")
            assert losses["oracle"] > 0
            for mode in ("full", "chunked"):
                assert abs(losses[mode] - losses["oracle"]) <= 1e-6 * losses["oracle"], (name, rank, mode)
        for mode, worst in result["grads"].items():
            print(f"{name} {mode}: {result['num_grads']} gradients (norm {result['grad_norm']:.3e}), worst relative "
                  f"difference from the own loss's {worst['rel']:.1e} (abs {worst['abs']:.1e}, {worst['worst']})")
            assert worst["rel"] <= 1e-5, (name, mode, worst)
        assert result["grad_norm"] > 0
