"""SequenceParallel.shard (odb/training/step/sequence_parallel.py): a packed row cut into the slices
the ranks of a group hold, against the worked example of its docstring written out by hand."""

import torch

from odb.data.collate import collate_packed
from odb.training.step.sequence_parallel import SequenceParallel

A, B = [101, 102, 103, 104, 105], [201, 202]  # a0..a4, b0 b1
PAD = 0


def slices(size: int, samples, sources=None):
    batch = collate_packed([{"input_ids": s} for s in samples])
    labels = batch.pop("labels")
    return [SequenceParallel(size=size, member=m, group=None).shard(batch, labels, pad_token_id=PAD, sources=sources)
            for m in range(size)]


def test_the_docstring_row_of_seven_tokens_on_two_ranks():
    (first, shifted0, _, real0), (second, shifted1, _, real1) = slices(2, [A, B])
    assert first["input_ids"].tolist() == [[101, 102, 103, 104]]
    assert second["input_ids"].tolist() == [[105, 201, 202, PAD]]
    assert first["position_ids"].tolist() == [[0, 1, 2, 3]] and second["position_ids"].tolist() == [[4, 0, 1, 0]]
    # what each position predicts: a3's target a4 lies on rank 1; b0 and the pad predict nothing across
    assert shifted0.tolist() == [[102, 103, 104, 105]] and shifted1.tolist() == [[-100, 202, -100, -100]]
    assert real0.tolist() == [[1, 1, 1, 1]] and real1.tolist() == [[1, 1, 1, 0]]
    assert set(first) == {"input_ids", "position_ids"}  # the row's bounds come from the gathered position ids


def test_a_row_shorter_than_the_group_leaves_a_rank_padding_alone():
    parts = slices(4, [[7, 8, 9, 10, 11]])  # 5 tokens -> 8: slices of 2
    assert [p[0]["input_ids"].tolist() for p in parts] == [[[7, 8]], [[9, 10]], [[11, PAD]], [[PAD, PAD]]]
    assert [p[3].tolist() for p in parts] == [[[1, 1]], [[1, 1]], [[1, 0]], [[0, 0]]]
    assert [p[1].tolist() for p in parts] == [[[8, 9]], [[10, 11]], [[-100, -100]], [[-100, -100]]]


def test_sources_are_shifted_with_the_labels():
    sources = torch.tensor([[0] * 5 + [3] * 2])
    (_, _, src0, _), (_, _, src1, _) = slices(2, [A, B], sources=sources)
    assert src0.tolist() == [[0, 0, 0, 0]] and src1.tolist() == [[3, 3, 0, 0]]
