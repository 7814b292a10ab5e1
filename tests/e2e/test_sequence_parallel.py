"""Sequence parallelism on 2 and 4 CPU ranks under ZeRO-3 (tests/e2e/sequence_parallel_worker.py).

Each group of S ranks trains its micro-batches together, each rank on its slice of every packed
row (packed rows of several samples, a sample longer than a rank's budget, a dummy), through
DeepSpeed's Ulysses all-to-all around odb's attention. The oracle is one plain process, the model's
own eager attention and loss on each sample alone: the step's gradient (full-logits and chunked
loss) must agree with it to 1e-5 relative to each parameter's largest entry, and the loss each
group reports, in all and per source, to 1e-6.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launch import deepspeed

WORKER = Path(__file__).resolve().parent / "sequence_parallel_worker.py"


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_loss_and_gradients_equal_one_process_on_each_sample_alone(tmp_path, world):
    start = time.monotonic()
    deepspeed([str(tmp_path)], nproc=world, timeout=600, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    print(f"launch took {time.monotonic() - start:.0f} s")
    assert set(ranks[0]) == {f"S{s} {m}" for s in ((2,) if world == 2 else (2, 4)) for m in ("qwen2_lora", "gemma2")}
    for name, result in ranks[0].items():
        for rank, values in enumerate(ranks):
            losses, sources = values[name]["losses"], values[name]["sources"]
            print(f"{name} rank {rank}: group loss full {losses['full']:.6f}, chunked {losses['chunked']:.6f}, "
                  f"own {losses['oracle']:.6f}; per source {sources}")
            assert losses["oracle"] > 0
            for mode in ("full", "chunked"):
                assert abs(losses[mode] - losses["oracle"]) <= 1e-6 * losses["oracle"], (name, rank, mode)
                assert sources[mode].keys() == sources["oracle"].keys(), (name, rank, sources)
                for source, own in sources["oracle"].items():
                    assert abs(sources[mode][source] - own) <= 1e-6 * own, (name, rank, mode, source)
        for mode, worst in result["grads"].items():
            print(f"{name} {mode}: worst relative gradient difference from the own loss's {worst['rel']:.1e} "
                  f"(abs {worst['abs']:.1e}, {worst['worst']}), norm {result['grad_norm']:.3e}")
            assert worst["rel"] <= 1e-5, (name, mode, worst)
        assert result["grad_norm"] > 0
