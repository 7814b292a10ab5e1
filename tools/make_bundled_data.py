#!/usr/bin/env python
"""Writes the bundled default data: a chat set with heterogeneous lengths and its tokenizer.

    python tools/make_bundled_data.py            # -> data/chat.jsonl, data/tokenizer/

Synthetic and learnable (repeat, reverse, sort, count, small talk; 1-4 turns, optional system
prompt), so a tiny model's loss visibly falls in one epoch. Deterministic (seeded); rerunning it
reproduces the committed files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
WORDS = ("apple river stone cloud green quiet bright lamp window garden music paper silver north "
         "winter summer forest ocean mountain valley bridge street candle mirror letter number "
         "yellow orange purple gentle rapid simple golden hidden open narrow wide early late "
         "morning evening market harbor island meadow planet rocket signal engine pocket ticket "
         "castle dragon feather hammer ladder needle pencil rabbit saddle tunnel violin wagon").split()
SYSTEMS = ["You are a helpful assistant.", "You are a precise assistant. Answer briefly.",
           "Follow the instruction exactly."]
GREETINGS = [("Hello!", "Hello! How can I help you today?"),
             ("Good morning.", "Good morning! What would you like to do?"),
             ("Thanks for the help.", "You are welcome. Ask me anything else."),
             ("Who are you?", "I am a small assistant trained on simple tasks.")]


def words(rng: random.Random) -> list[str]:
    n = max(2, min(600, int(rng.lognormvariate(3.2, 0.9))))
    return [rng.choice(WORDS) for _ in range(n)]


def turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.3:
        w = words(rng)
        return "Repeat these words: " + " ".join(w), " ".join(w)
    if kind < 0.55:
        w = words(rng)
        return "Reverse these words: " + " ".join(w), " ".join(reversed(w))
    if kind < 0.75:
        nums = [rng.randrange(1000) for _ in range(max(2, len(words(rng)) // 2))]
        return "Sort these numbers: " + " ".join(map(str, nums)), " ".join(map(str, sorted(nums)))
    if kind < 0.9:
        w = words(rng)
        return "How many words are in: " + " ".join(w), f"There are {len(w)} words."
    return rng.choice(GREETINGS)


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 4])):
        user, assistant = turn(rng)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def write_tokenizer(texts: list[str], folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def main() -> None:
    rng = random.Random(20261129)
    rows = [conversation(rng) for _ in range(2000)]
    DATA.mkdir(exist_ok=True)
    with open(DATA / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    texts = [m["content"] for row in rows for m in row["messages"]]
    write_tokenizer(texts, DATA / "tokenizer")


if __name__ == "__main__":
    main()
