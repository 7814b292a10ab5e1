"""Sequence parallelism's cut of a packed row, fuzzed (odb/training/step/sequence_parallel.py): random
rows (1-6 samples of 1-30 tokens, random label masks and sources), groups of S = 2, 3, 4 or 8
ranks (rows shorter than S, rows that leave a rank padding alone).

What the S slices must add up to, without the all-to-all (it only moves heads; tests/e2e/
test_sequence_parallel.py runs it): each rank's slice of the final hidden states is what the whole
row computes at those positions, so the model runs once on the padded row as the attention sees it
under Ulysses (the gathered ``position_ids``, no bounds), and each slice's loss is taken from its
positions with that slice's shifted labels and sources. The oracle: the model's own eager attention
and own ``labels=`` loss on each sample alone (Gemma-2 with final soft-capping 30). Checked:

* the slices laid end to end are the row, padded to a multiple of S, each the same width;
* the samples the attention finds in the gathered positions are the row's, the padding one more;
* the slices' summed losses (chunked and full-logits), in all and per source, equal the samples'
  own; the slices' ``real`` tokens are the row's exactly once (the router loss weighs by them).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_step import _new, base_state, counted, labels_of, own_loss_sum

from odb.data.collate import collate_packed, token_sources
from odb.training import attention
from odb.training.step.loss import chunked_token_loss_sum, final_logit_softcap, token_loss_sum
from odb.training.step.sequence_parallel import SequenceParallel
from odb.training.step.sources import SourceSplit

LOSS_RTOL = 1e-5
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def rows(draw):
    samples = []
    for n in draw(st.lists(st.integers(1, 30), min_size=1, max_size=6)):
        ids = draw(st.lists(st.integers(10, 999), min_size=n, max_size=n))
        samples.append({"input_ids": ids, "labels": labels_of(draw, ids), "source": draw(st.integers(0, 2))})
    return {"samples": samples, "size": draw(st.sampled_from([2, 3, 4, 8])),
            "family": draw(st.sampled_from(["llama", "gemma2"])), "chunks": draw(st.integers(1, 9))}


@FUZZ
@given(rows())
@torch.no_grad()
def test_the_slices_of_a_fuzzed_row_add_up_to_its_samples_alone(case):
    samples, size = case["samples"], case["size"]
    batch = collate_packed(samples, sources=True)
    sources = token_sources(batch)
    labels = batch.pop("labels")
    length = labels.shape[1]
    parts = [SequenceParallel(size=size, member=m, group=None).shard(batch, labels, pad_token_id=0, sources=sources)
             for m in range(size)]
    widths = {p[0]["input_ids"].shape[1] for p in parts}
    assert len(widths) == 1 and size * widths.pop() == length + (-length % size)
    ids = torch.cat([p[0]["input_ids"] for p in parts], dim=1)
    positions = torch.cat([p[0]["position_ids"] for p in parts], dim=1)
    assert ids[0, :length].tolist() == [t for s in samples for t in s["input_ids"]]
    assert ids[0, length:].eq(0).all()
    found = attention.cu_seqlens_from_position_ids(positions).tolist()
    row = [0, *torch.tensor([len(s["input_ids"]) for s in samples]).cumsum(0).tolist()]
    assert found == (row if found[-1] == length else [*row, ids.shape[1]])
    real = torch.cat([p[3] for p in parts], dim=1)
    assert real.sum() == length and real[0, :length].eq(1).all()

    model = _new(case["family"], attention.register())
    model.load_state_dict(base_state(case["family"]))
    oracle = _new(case["family"], "eager")
    oracle.load_state_dict(base_state(case["family"]))
    seen = {}
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: seen.setdefault("hidden", args[0]))
    try:
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # the attention finds the samples
    finally:
        handle.remove()
    width = ids.shape[1] // size
    present = sorted({s["source"] for s in samples})
    chunked, full = torch.zeros(()), torch.zeros(())
    by_source = torch.zeros(3, dtype=torch.float64)
    for m, (_, shifted, source_part, _) in enumerate(parts):
        at = slice(m * width, (m + 1) * width)
        split = SourceSplit(source_part, present, shifted=True)
        chunked = chunked + chunked_token_loss_sum(seen["hidden"][:, at], shifted, head, num_chunks=case["chunks"],
                                                   softcap=final_logit_softcap(model.config), split=split,
                                                   shifted=True)
        by_source[:split.sums.numel()] += split.sums
        full = full + token_loss_sum(logits[:, at], shifted, shifted=True)
    expected = [float(own_loss_sum(oracle, s)) for s in samples]
    total = sum(expected)
    for name, got in (("chunked", chunked), ("full logits", full)):
        assert abs(float(got) - total) <= LOSS_RTOL * max(total, 1.0), (name, float(got), total)
    for source in range(3):
        want = sum(e for e, s in zip(expected, samples, strict=True) if s["source"] == source)
        assert abs(float(by_source[source]) - want) <= LOSS_RTOL * max(want, 1.0), (source, by_source, want)
    assert sum((p[1] != -100).sum() for p in parts) == sum(counted(s) for s in samples)
