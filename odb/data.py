"""Chat data processed in DataLoader workers: messages -> ``input_ids`` and ``labels``.

The true length of a sample is known only here, after the chat template and tokenization; the
batcher sees it through :func:`sample_cost`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from odb.cost import count_label_tokens

__all__ = ["ChatDataset", "sample_cost"]


class ChatDataset(Dataset):
    """A JSONL file of ``{"messages": [{"role", "content"}, ...]}`` (OpenAI style).

    Indexed by uid (``epoch * len + index``): a uid processes dataset item ``uid % len``. Labels
    are the assistant turns (the template's ``{% generation %}`` blocks); other tokens are -100.
    ``truncate_to`` cuts samples here, so that the cost the batcher sees is the row it trains.
    """

    def __init__(self, path: str | Path, tokenizer, *, max_samples: int | None = None,
                 truncate_to: int | None = None) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data file {path} does not exist; pass --data data/chat.jsonl or "
                                    "a JSONL file of {'messages': [...]} records")
        with open(path) as f:
            self.rows = [line for line in f if line.strip()]
        if max_samples is not None:
            self.rows = self.rows[:max_samples]
        if not self.rows:
            raise ValueError(f"data file {path} holds no samples")
        self.path = path
        self.tokenizer = tokenizer
        self.truncate_to = truncate_to

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, uid: int) -> dict[str, Any]:
        index = uid % len(self.rows)
        messages = json.loads(self.rows[index])["messages"]
        encoded = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
        input_ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
        mask = torch.tensor(encoded["assistant_masks"], dtype=torch.bool)
        labels = torch.where(mask, input_ids, torch.full_like(input_ids, -100))
        if self.truncate_to is not None:  # the over-cap policy 'truncate', applied to the tensors
            input_ids, labels = input_ids[:self.truncate_to], labels[:self.truncate_to]
        return {"uid": uid, "index": index, "input_ids": input_ids, "labels": labels}


def sample_cost(sample: dict[str, Any]) -> tuple[int, int, int]:
    """``(tokens, label_tokens, vision_patches)`` of a processed sample, for the batcher."""
    labels = sample["labels"]
    return (len(sample["input_ids"]), count_label_tokens(labels.tolist()), int(sample.get("patches", 0)))
