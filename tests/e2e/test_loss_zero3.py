"""The chunked loss under ZeRO-3 on two CPU ranks (tests/e2e/loss_zero3_worker.py, one launch).

Every parameter is partitioned, so each call of the LM head is a collective gather: ranks whose
micro-batches score different numbers of tokens (and a dummy on one) must still call the head
equally often, or the launch hangs (and times out here). The oracle is the full-logits loss on
the same engine, plan and weights: the step's gradient, gathered before the optimizer step, must
agree to 1e-5 (relative to each parameter's largest entry) and each rank's loss sum to 1e-6.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launch import deepspeed

WORKER = Path(__file__).resolve().parent / "loss_zero3_worker.py"


@pytest.mark.e2e
def test_chunked_loss_gradient_equals_full_logits_at_zero3_on_two_ranks(tmp_path):
    start = time.monotonic()
    deepspeed([str(tmp_path)], timeout=420, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"launch took {time.monotonic() - start:.0f} s")
    for name, result in ranks[0].items():
        for rank, values in enumerate(ranks):
            full, chunked = values[name]["losses"]["full"], values[name]["losses"]["chunked"]
            print(f"{name} rank {rank}: loss sum full {full:.6f}, chunked {chunked:.6f}")
            assert abs(chunked - full) <= 1e-6 * abs(full) and full > 0
        print(f"{name}: {result['num_grads']} gradients (norm {result['grad_norm']:.3e}), worst relative "
              f"difference {result['grad_rel']:.1e} (abs {result['grad_abs']:.1e}, {result['worst']})")
        assert result["grad_norm"] > 0 and result["grad_rel"] <= 1e-5
