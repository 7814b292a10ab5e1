"""Preference objectives on two CPU ranks (tests/e2e/preference_ranks_worker.py, one launch):
one optimizer step equals one process over the whole step, under DeepSpeed ZeRO-3 and FSDP2 (a
reward model's and a vision-language model's too).

The ranks hold 4 and 1 of the step's 5 pairs, one of them in a dummy micro-batch; each micro-batch
backs its pairs' losses times W / P_s (P_s: the step's pairs on all ranks), so the reduced gradient
is the mean over all 5. Under ZeRO-3 every parameter is partitioned, so every module call is a
collective gather: a LoRA run's reference forwards (the adapter disabled, no gradients), dummies
included, must keep the ranks' gathers aligned, or the launch hangs (and fails here within its
timeout). The oracle is one plain process with the model's own eager attention, each pair alone
and TRL's own loss code (tests/preference_oracle.py): the step's gradient, gathered whole before
the optimizer step, must hold the oracle's parameters (one left frozen is missing) and agree with
it to 1e-5 relative to each parameter's largest entry; each rank's summed loss must agree to 1e-5
and its rewards to 1e-5 (+ 1e-4: a reward is a difference of two log-probabilities of some -300,
each exact to some 1e-5 in fp32), the pairs ranked right exactly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from launch import deepspeed

WORKER = Path(__file__).resolve().parent / "preference_ranks_worker.py"
CASES = ("dpo_lora_adapter", "simpo_full", "ipo_full_data", "reward_lora", "dpo_vl_data")
BACKENDS = ("deepspeed", "fsdp2")


def close(got: float, want: float, *, floor: float = 1e-6) -> bool:
    return abs(got - want) <= 1e-5 * abs(want) + floor


def failures(name: str, kind: str, rank: int, got: dict, want: dict) -> list[str]:
    """What of one backend's step on one rank differs from the oracle's."""
    where = f"{name} {kind} rank {rank}"
    out = [] if close(got["loss_sum"], want["loss_sum"]) else [f"{where}: loss sum"]
    if not all(close(a, b, floor=1e-4) for a, b in zip(got["rewards"][:2], want["rewards"][:2])):
        out.append(f"{where}: rewards")
    if got["rewards"][2] != want["rewards"][2]:
        out.append(f"{where}: pairs ranked right")
    if not got["grads"]["rel"] <= 1e-5:
        out.append(f"{where}: gradient {got['grads']}")
    return out


@pytest.mark.e2e
def test_a_preference_step_on_two_ranks_equals_one_process_under_zero3_and_fsdp2(tmp_path):
    start = time.monotonic()
    deepspeed([str(tmp_path)], timeout=240, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"launch took {time.monotonic() - start:.0f} s")
    assert set(ranks[0]) == set(CASES)
    wrong: list[str] = []
    for name in CASES:
        want = ranks[0][name]["oracle"]
        print(f"{name}: oracle mean loss {want['mean']:.6f}, {want['num_grads']} gradients (norm "
              f"{want['grad_norm']:.3e})")
        assert want["grad_norm"] > 0
        if name == "dpo_lora_adapter":  # the policy is not its reference (loss log 2 at equality)
            assert abs(want["mean"] - math.log(2)) > 1e-2
        for rank, values in enumerate(ranks):
            want = values[name]["oracle"]
            for kind in BACKENDS:
                got = values[name][kind]
                print(f"  {kind} rank {rank}: loss sum {got['loss_sum']:.6f} (oracle {want['loss_sum']:.6f}), "
                      f"rewards {got['rewards'][0]:.4f} {got['rewards'][1]:.4f} {got['rewards'][2]} (oracle "
                      f"{want['rewards'][0]:.4f} {want['rewards'][1]:.4f} {want['rewards'][2]}); gradients' worst "
                      f"relative difference {got['grads']['rel']:.1e} (abs {got['grads']['abs']:.1e}, "
                      f"{got['grads']['worst']})")
                wrong += failures(name, kind, rank, got, want)
    assert not wrong, wrong
