import pytest
import torch

from odb.batching.cost import count_label_tokens
from odb.data.collate import collate_packed, collate_padded


def test_worked_example_of_the_docstring():
    a = {"input_ids": [11, 12, 13]}
    b = {"input_ids": torch.tensor([21, 22]), "labels": torch.tensor([21, 22])}
    batch = collate_packed([a, b])
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 12, 13, -100, 22]]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert batch["cu_seq_lens_k"] is batch["cu_seq_lens_q"]
    assert batch["max_length_q"] == batch["max_length_k"] == 3


def test_label_count_matches_the_cost_model():
    samples = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}, {"input_ids": [5, 6], "labels": [5, 6]}]
    batch = collate_packed(samples)
    expected = sum(count_label_tokens(s["labels"]) for s in samples)
    assert int((batch["labels"] != -100).sum()) == expected == 3


def test_truncation_keeps_the_first_max_tokens():
    batch = collate_packed([{"input_ids": list(range(10))}], max_tokens=4)
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3]] and batch["cu_seq_lens_q"].tolist() == [0, 4]


def test_padded_layout_for_baselines():
    batch = collate_padded([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [-100, -100, -100]]


def test_bad_input():
    with pytest.raises(ValueError, match="empty bin"):
        collate_packed([])
    with pytest.raises(ValueError, match="empty sample"):
        collate_packed([{"input_ids": []}])
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        collate_packed([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


def test_videos_seconds_per_video_filled_and_checked():
    """Qwen2.5-VL's seconds per temporal patch: one per video, in order; 1.0 (the model's default)
    for a sample's videos that have none; a count that differs from the sample's videos is refused."""
    grid = torch.tensor([[1, 2, 2]])
    video = {"input_ids": [1, 2], "labels": [1, 2], "pixel_values_videos": torch.zeros(4, 3), "video_grid_thw": grid}
    samples = [{**video, "second_per_grid_ts": torch.tensor([0.5])}, {**video, "input_ids": [3], "labels": [3]}, video,
               {**video, "video_grid_thw": torch.cat([grid, grid]), "second_per_grid_ts": [2.0, 0.25]}]
    batch = collate_packed(samples)
    assert batch["video_grid_thw"].shape == (5, 3)
    assert batch["second_per_grid_ts"].tolist() == [0.5, 1.0, 1.0, 2.0, 0.25]
    with pytest.raises(ValueError, match="2 video"):
        collate_packed([{**video, "video_grid_thw": torch.cat([grid, grid]), "second_per_grid_ts": [1.0]}])
