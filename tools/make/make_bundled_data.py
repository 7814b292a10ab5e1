#!/usr/bin/env python
"""Writes the bundled default data: a chat set with heterogeneous lengths and its tokenizer.

    python tools/make/make_bundled_data.py   # -> data/chat.jsonl, data/tokenizer/, data/mm/

Synthetic and learnable (repeat, reverse, sort, count, small talk; 1-4 turns, optional system
prompt), so a tiny model's loss visibly falls in one epoch. Deterministic (seeded); rerunning it
reproduces the committed files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"
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
SPECIAL = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|vision_start|>",
           "<|vision_end|>", "<|image_pad|>"]
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
          "purple": (140, 60, 180), "orange": (240, 140, 30)}
SHAPES = ("square", "circle", "triangle")


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


def draw(rng: random.Random, path: Path) -> tuple[str, str, int]:
    """A shape of one color on a grey background, of a random size (so images cost differently)."""
    from PIL import Image, ImageDraw

    width, height = rng.randrange(56, 336), rng.randrange(56, 336)
    color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
    image = Image.new("RGB", (width, height), (200, 200, 200))
    pen = ImageDraw.Draw(image)
    x0, y0 = rng.randrange(0, width // 3), rng.randrange(0, height // 3)
    x1, y1 = x0 + max(8, width // 2), y0 + max(8, height // 2)
    if shape == "square":
        pen.rectangle([x0, y0, x1, y1], fill=COLORS[color])
    elif shape == "circle":
        pen.ellipse([x0, y0, x1, y1], fill=COLORS[color])
    else:
        pen.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=COLORS[color])
    image.save(path, optimize=True)
    count = rng.randrange(1, 6)
    return color, shape, count


def multimodal(rng: random.Random, folder: Path, num: int = 300) -> None:
    """LLaVA-style records with generated images: data/mm/train.jsonl and data/mm/images/."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for i in range(num):
            name = f"images/{i:04d}.png"
            color, shape, _ = draw(rng, folder / name)
            question = rng.choice([f"What color is the {shape}?", "Which shape is in the picture?",
                                   "Describe the picture."])
            if question.startswith("What color"):
                answer = f"The {shape} is {color}."
            elif question.startswith("Which shape"):
                answer = f"It is a {shape}."
            else:
                answer = f"A {color} {shape} on a grey background."
            conversations = [{"from": "human", "value": "<image>\n" + question},
                             {"from": "gpt", "value": answer}]
            if rng.random() < 0.3:  # a text follow-up turn makes lengths uneven
                user, assistant = turn(rng)
                conversations += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
            f.write(json.dumps({"id": i, "image": name, "conversations": conversations}) + "\n")


def main() -> None:
    rng = random.Random(20261129)
    rows = [conversation(rng) for _ in range(2000)]
    DATA.mkdir(exist_ok=True)
    with open(DATA / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    texts = [m["content"] for row in rows for m in row["messages"]]
    write_tokenizer(texts, DATA / "tokenizer")
    multimodal(random.Random(7), DATA / "mm")


if __name__ == "__main__":
    main()
