"""The rows' model FLOPs (odb/telemetry/flops.py, odb/training/model/build.py flops_model) against
torch's own FLOP counter on a real forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from odb.telemetry.flops import FlopsModel, step_flops
from odb.training.model.build import flops_model


@pytest.mark.parametrize("tied", [True, False])
def test_the_model_flops_of_a_step_are_what_torch_counts(tied):
    """torch counts every matmul of the forward and backward (6 N T for the linear layers and the
    head) and the attention in full (12 layers hidden L^2 forward and backward, the causal half
    included); odb's formula halves the attention term for causal kernels."""
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # (attention as matmuls)
    flops = flops_model(model, torch.device("cpu"), torch.float32)
    length = 96
    ids = torch.randint(512, (1, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops()
    attention_full = 12 * config.num_hidden_layers * config.hidden_size * length ** 2
    ours = step_flops(matmul_params=flops.matmul_params, layers=flops.layers, hidden=flops.hidden, tokens=length,
                      attn_area=length ** 2)
    assert ours - 6 * config.num_hidden_layers * config.hidden_size * length ** 2 == pytest.approx(
        counted - attention_full, rel=1e-9)
    assert flops.peak_flops is None  # a CPU: no MFU


def test_mfu_is_the_model_flops_over_what_the_devices_could_do():
    model = FlopsModel(matmul_params=1000, layers=2, hidden=8, peak_flops=1e6)
    flops = 6 * 1000 * 50 + 6 * 2 * 8 * 900
    assert model.mfu(tokens=50, attn_area=900, seconds=2.0, world_size=4) == pytest.approx(flops / (2.0 * 4 * 1e6))
    assert FlopsModel(matmul_params=1, layers=1, hidden=1, peak_flops=None).mfu(
        tokens=1, attn_area=1, seconds=1.0, world_size=1) is None
