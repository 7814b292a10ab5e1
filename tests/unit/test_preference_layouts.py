"""Preference objectives refuse padded micro-batches at start: odb's padded bins hold
``samples x longest <= max_tokens`` with a pair counted as one sample of both its sequences' tokens,
but a pair trains as two rows, each padded to the longer sequence (up to twice the cap, I5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import train_defaults
from odb.batching.cost import CostModel, count_label_tokens
from odb.batching.packer import OnlinePacker
from odb.data.collate import collate_padded
from odb.data.preference import pair_sequences
from odb.training.backends import LocalBackend
from odb.training.launch.flags import parse_config
from odb.training.model.build import build_model
from odb.training.run import assemble

ROOT = Path(__file__).resolve().parents[2]


def test_a_padded_bin_of_one_pair_would_be_twice_what_the_batcher_planned():
    """Why padded micro-batches are refused: the batcher's figure and the rows the pair makes."""
    ids = torch.arange(1010) % 50 + 3
    labels = ids.clone()
    labels[:5] = labels[1000:1005] = -100
    sample = {"uid": 0, "index": 0, "source": 0, "input_ids": ids, "labels": labels, "pair": (1000, 10)}
    cost_model = CostModel(max_tokens=1024)
    cost, outcome = cost_model.measure(0, len(ids), count_label_tokens(labels.tolist()), 0, labels.tolist())
    packer = OnlinePacker(cost_model, min_fill=0.0, max_carry=0.0, padded=True)
    packer.add([cost])
    packer.pack(16, True)
    assert outcome == "ok" and [b.materialized for b in packer.bins] == [1010]
    rows = collate_padded(pair_sequences(sample), pad_token_id=0, max_tokens=1024)["input_ids"]
    assert rows.numel() == 2000 > 1024


@pytest.mark.parametrize("policy", ["gmt", "bmt"])  # (fixed: batch_size pairs, no budget to keep)
def test_a_padded_baseline_policy_under_a_budget_is_refused(tmp_path, policy):
    with pytest.raises(ValueError, match="pads its micro-batches.*up to twice max_tokens"):
        parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "simpo", "--policy", policy],
                     defaults=train_defaults())


def test_a_model_odb_cannot_pack_is_refused_before_the_data(tmp_path, monkeypatch):
    config = parse_config(["--output_dir", str(tmp_path / "o"), "--objective", "simpo"],
                          defaults=train_defaults())
    monkeypatch.setattr(assemble, "supports_packing", lambda model: False)
    monkeypatch.setattr(assemble, "build_datasets", lambda *a, **k: pytest.fail("the data was indexed first"))
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=1024)
    with pytest.raises(ValueError, match="odb cannot pack llama.*up to twice max_tokens"):
        assemble.build_components(config, rank=0, world_size=1, report=lambda: None, on_reports=lambda r: None,
                                  log=print, backend=LocalBackend(model))
