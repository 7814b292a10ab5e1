"""odb_varlen's attention function, fuzzed against transformers' own eager attention on each sample
alone (STYLE 16): random rows of 1-14 samples of 1-40 tokens (one-token samples, many samples of
one length, one long beside short ones: the grouped path's every grouping), several rows at once
(samples marked by positions restarting at 0), GQA 1:1 to 4:1, and what a layer asks for: causal,
a sliding window of 1 to 20 (narrower and wider than the samples), soft-capping (Gemma-2's eager
attention is the oracle), attention sinks (gpt-oss's), bidirectional (a vision tower's). The
output and the gradients of q, k, v (and the sinks) of a random linear loss, to 1e-5 of their
largest entry, samples given by ``cu_seq_lens_q`` and by ``position_ids`` alike."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention

from odb.training import attention

TOLERANCE = 1e-5
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Layer(torch.nn.Module):
    """What the eager attention functions read from their module."""

    def __init__(self, groups: int, sinks: torch.Tensor | None) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.sinks = groups, True, sinks


@st.composite
def calls(draw):
    rows = draw(st.integers(1, 3))
    lengths = [draw(st.lists(st.integers(1, 40), min_size=1, max_size=14)) for _ in range(rows)]
    if rows > 1:  # rows of one length: pad the shorter ones with a sample of their own
        width = max(map(sum, lengths))
        lengths = [row + ([width - sum(row)] if sum(row) < width else []) for row in lengths]
    kv_heads, groups = draw(st.sampled_from([(4, 1), (2, 2), (1, 4), (1, 2)]))
    kind = draw(st.sampled_from(["causal", "window", "softcap", "window+softcap", "sinks", "window+sinks",
                                 "bidirectional", "bidirectional+sinks"]))
    return {"lengths": lengths, "kv_heads": kv_heads, "groups": groups, "kind": kind,
            "window": draw(st.integers(1, 20)), "softcap": draw(st.floats(0.3, 3.0)), "seed": draw(st.integers(0, 99)),
            "by_positions": draw(st.booleans()) or rows > 1}


def mask_function(case):
    if case["kind"].startswith("bidirectional"):
        return and_masks(bidirectional_mask_function)
    return sliding_window_causal_mask_function(case["window"]) if "window" in case["kind"] else causal_mask_function


@FUZZ
@given(calls())
def test_a_fuzzed_packed_call_equals_eager_attention_on_each_sample_alone(case):
    lengths, kind = case["lengths"], case["kind"]
    rows, width = len(lengths), sum(lengths[0])
    heads, kv_heads = case["kv_heads"] * case["groups"], case["kv_heads"]
    gen = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(rows, heads, width, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(rows, kv_heads, width, 8, generator=gen).requires_grad_() for _ in range(2))
    sinks = torch.randn(heads, generator=gen).requires_grad_() if "sinks" in kind else None
    weights = torch.randn(rows, width, heads, 8, generator=gen)  # a random linear loss of the output
    module = _Layer(case["groups"], sinks)
    softcap = case["softcap"] if "softcap" in kind else None
    allowed_of = mask_function(case)
    expected = torch.zeros(rows, width, heads, 8)
    for row, row_lengths in enumerate(lengths):
        bounds = [0, *torch.tensor(row_lengths).cumsum(0).tolist()]
        for start, end in pairwise(bounds):
            index = torch.arange(end - start)
            allowed = allowed_of(0, 0, index[:, None], index[None, :])
            mask = torch.zeros(end - start, end - start).masked_fill(~allowed, torch.finfo(q.dtype).min)
            pieces = [t[row:row + 1, :, start:end] for t in (q, k, v)]
            if sinks is None:
                alone, _ = eager_attention_forward(module, *pieces, mask[None, None], scaling=0.3, softcap=softcap)
            else:
                alone, _ = gpt_oss_eager_attention(module, *pieces, mask[None, None], scaling=0.3)
            expected[row, start:end] = alone[0]
    inputs = [q, k, v, *([] if sinks is None else [sinks])]
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    kwargs = {"scaling": 0.3, "softcap": softcap, "s_aux": sinks, "is_causal": not kind.startswith("bidirectional"),
              "sliding_window": case["window"] if "window" in kind else None}
    if case["by_positions"]:
        kwargs["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    else:
        cu = torch.tensor([0, *torch.tensor(lengths[0]).cumsum(0).tolist()], dtype=torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    out, _ = attention.varlen_attention(module, q, k, v, None, **kwargs)
    diff = float((out - expected).detach().abs().max())
    assert diff <= TOLERANCE * max(float(expected.abs().max()), 1.0), f"{kind}: output off by {diff:.2e}"
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    for name, got, want in zip("q k v sinks".split(), grads, expected_grads):
        diff = float((got - want).abs().max())
        assert diff <= TOLERANCE * max(float(want.abs().max()), 1.0), f"{kind}: gradient of {name} off by {diff:.2e}"
