#!/usr/bin/env python
"""Writes the bundled default data: a chat set with heterogeneous lengths, its tokenizer, the
vision-language demo's tokenizer and the multimodal set.

    python tools/make/make_bundled_data.py   # -> data/chat.jsonl, data/tokenizer/, data/vl_tokenizer/, data/mm/

Synthetic and learnable (repeat, reverse, sort, count, small talk; 1-4 turns, optional system
prompt), so a tiny model's loss visibly falls in one epoch. data/vl_tokenizer is data/tokenizer
plus ``<|video_pad|>`` (id 1024, the video token of configs/tiny_vl_model.json). data/mm holds
image records (a shape of one color), video records (MPEG-4 clips of a shape moving one way:
needs PyAV, the ``video`` extra) and text records, in one LLaVA-style file. Deterministic (seeded);
rerunning it reproduces the committed files (the clips: with the same FFmpeg, which PyAV carries).
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
VIDEO_PAD = "<|video_pad|>"
"""The video token of the VL demo's tokenizer (data/vl_tokenizer), after every token of data/tokenizer."""
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
          "purple": (140, 60, 180), "orange": (240, 140, 30)}
SHAPES = ("square", "circle", "triangle")


def write_tokenizer(texts: list[str], folder: Path):
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
    return fast


def write_vl_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer`` (changed in place) plus :data:`VIDEO_PAD` as a token of its own, appended (id
    1024): every text encodes as before."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(VIDEO_PAD, special=True, normalized=False)])
    tokenizer.save_pretrained(folder)


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


def picture(rng: random.Random, name: str, folder: Path) -> dict:
    """An image record: a question on the drawn shape, sometimes a text follow-up turn."""
    color, shape, _ = draw(rng, folder / name)
    question = rng.choice([f"What color is the {shape}?", "Which shape is in the picture?", "Describe the picture."])
    if question.startswith("What color"):
        answer = f"The {shape} is {color}."
    elif question.startswith("Which shape"):
        answer = f"It is a {shape}."
    else:
        answer = f"A {color} {shape} on a grey background."
    conversations = [{"from": "human", "value": "<image>\n" + question}, {"from": "gpt", "value": answer}]
    if rng.random() < 0.3:  # a text follow-up turn makes lengths uneven
        user, assistant = turn(rng)
        conversations += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
    return {"image": name, "conversations": conversations}


DIRECTIONS = {"right": ("x", 1), "left": ("x", -1), "down": ("y", 1), "up": ("y", -1)}
"""Each way a clip's shape moves: its axis and sign (image coordinates: y grows downward)."""
CLIP_FPS = 4


def film(rng: random.Random, path: Path) -> tuple[str, str, str]:
    """An MPEG-4 clip of a shape of one color moving one way over a grey background: 8 or 12 frames
    at :data:`CLIP_FPS` (2 or 3 s: 4 or 6 frames sampled at 2 a second, 2 or 3 temporal groups),
    of a random size."""
    import av
    import numpy as np
    from PIL import Image, ImageDraw

    width, height = rng.randrange(64, 161, 16), rng.randrange(64, 129, 16)
    color, shape, direction = rng.choice(sorted(COLORS)), rng.choice(SHAPES), rng.choice(sorted(DIRECTIONS))
    frames, side = rng.choice((8, 12)), min(width, height) // 3
    axis, sign = DIRECTIONS[direction]
    travel = (width if axis == "x" else height) - side  # from one edge to the other along the motion
    start, step = (0 if sign > 0 else travel), travel // (frames - 1)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=CLIP_FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            image = Image.new("RGB", (width, height), (200, 200, 200))
            along = start + sign * step * i
            x0, y0 = (along, (height - side) // 2) if axis == "x" else ((width - side) // 2, along)
            box = [x0, y0, x0 + side, y0 + side]
            pen = ImageDraw.Draw(image)
            if shape == "square":
                pen.rectangle(box, fill=COLORS[color])
            elif shape == "circle":
                pen.ellipse(box, fill=COLORS[color])
            else:
                pen.polygon([(x0, y0 + side), (x0 + side // 2, y0), (x0 + side, y0 + side)], fill=COLORS[color])
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(image), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return color, shape, direction


def clip(rng: random.Random, name: str, folder: Path) -> dict:
    """A video record: a question on the moving shape."""
    color, shape, direction = film(rng, folder / name)
    question = rng.choice([f"Which way does the {shape} move?", "What color is the moving shape?",
                           "Describe the video."])
    if question.startswith("Which way"):
        answer = f"The {shape} moves {direction}."
    elif question.startswith("What color"):
        answer = f"It is {color}."
    else:
        answer = f"A {color} {shape} moves {direction} over a grey background."
    return {"video": name, "conversations": [{"from": "human", "value": "<video>\n" + question},
                                             {"from": "gpt", "value": answer}]}


def text(rng: random.Random) -> dict:
    """A text record: one exchange, no image or video."""
    user, assistant = turn(rng)
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]}


def multimodal(folder: Path, num_images: int = 300, num_videos: int = 24, num_texts: int = 24) -> None:
    """LLaVA-style records, images first, then videos, then text (training shuffles them):
    data/mm/train.jsonl, data/mm/images/ and data/mm/videos/."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    rng, other = random.Random(7), random.Random(11)  # (the images' own: adding videos kept them as they were)
    rows = [picture(rng, f"images/{i:04d}.png", folder) for i in range(num_images)]
    rows += [clip(other, f"videos/{i:04d}.mp4", folder) for i in range(num_videos)]
    rows += [text(other) for _ in range(num_texts)]
    with open(folder / "train.jsonl", "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": i, **row}) + "\n")


def main() -> None:
    rng = random.Random(20261129)
    rows = [conversation(rng) for _ in range(2000)]
    DATA.mkdir(exist_ok=True)
    with open(DATA / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    texts = [m["content"] for row in rows for m in row["messages"]]
    write_vl_tokenizer(write_tokenizer(texts, DATA / "tokenizer"), DATA / "vl_tokenizer")
    multimodal(DATA / "mm")


if __name__ == "__main__":
    main()
