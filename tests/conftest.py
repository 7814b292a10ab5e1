"""Shared test helpers (invariant checks over simulated ranks) and the test layers.

Every test is marked with its layer, the folder it lives in: ``unit``, ``sim``, ``dist`` or ``e2e``
(declared in pyproject.toml). A test that runs ``launch/train.py`` (it calls a helper of
tests/launch.py that does: ``deepspeed``, ``plain``, ...) is ``e2e`` wherever it lives, and so is
one marked ``@pytest.mark.e2e`` by hand (do that when the launch happens in a fixture or in a
helper of the test module). The fast inner loop is ``pytest -m "not e2e"``; ``pytest`` runs
every layer.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections import Counter
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from odb.batching.plan import StepPlan

LAYERS = ("unit", "sim", "dist", "e2e")


def train_defaults():
    """The default files of launch/train.py, as it names them (for tests that call parse_config)."""
    from odb.training.cli import FileDefaults

    configs = ROOT / "configs"
    return FileDefaults(deepspeed_config=configs / "ds_zero2.json", odb_config=configs / "odb.json",
                        model=configs / "tiny_model.json", data=ROOT / "data" / "chat.jsonl",
                        tokenizer=ROOT / "data" / "tokenizer", lora=configs / "lora.json",
                        fsdp_config=configs / "fsdp2.json")


@functools.cache
def bundled_tokenizer():
    """The bundled tokenizer (data/tokenizer), loaded once per test session."""
    from odb.training.model import load_tokenizer

    return load_tokenizer(ROOT / "data" / "tokenizer")


@pytest.fixture(scope="session")
def tokenizer():
    return bundled_tokenizer()


def _is_launcher(value: object) -> bool:
    """A helper of tests/launch.py that runs launch/train.py: its code names ``TRAIN``."""
    code = getattr(value, "__code__", None)
    return getattr(value, "__module__", None) == "launch" and code is not None and "TRAIN" in code.co_names


def _runs_the_trainer(item: pytest.Item) -> bool:
    """Whether the test function (or a function nested in it) calls a launcher of tests/launch.py."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    codes, names = [inspect.unwrap(function).__code__], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, CodeType))
    module = getattr(item, "module", None)
    return any(_is_launcher(getattr(module, name, None)) for name in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its layer: an explicit layer marker wins, then e2e for a test that runs
    the trainer, then the folder under tests/."""
    tests = Path(__file__).resolve().parent
    for item in items:
        layers = {layer for layer in LAYERS if item.get_closest_marker(layer)}
        if _runs_the_trainer(item):
            layers.add("e2e")
        if not layers:
            parts = item.path.resolve().relative_to(tests).parts
            if parts and parts[0] in LAYERS:
                layers.add(parts[0])
        for layer in sorted(layers):
            if not item.get_closest_marker(layer):
                item.add_marker(getattr(pytest.mark, layer))


def check_aligned(steps: list[list[StepPlan]]) -> None:
    """I1: every rank has the same steps and the same micro-batches per step."""
    shapes = [[(s.epoch, s.step, len(s.micro_batches)) for s in rank_steps] for rank_steps in steps]
    assert all(shape == shapes[0] for shape in shapes), "ranks are not aligned"


def check_exact_once(steps: list[list[StepPlan]], expected: Counter) -> None:
    """I2: the uids trained are exactly ``expected`` (no duplicates, nothing missing)."""
    trained = Counter(u for rank_steps in steps for s in rank_steps for m in s.micro_batches for u in m.uids)
    assert trained == expected, (f"missing {sorted((expected - trained).elements())[:10]}, "
                                 f"extra {sorted((trained - expected).elements())[:10]}")


def check_label_tokens(steps: list[list[StepPlan]]) -> None:
    """I4: every rank's N_step equals the label tokens of that step over all ranks (and the step's
    sample count its samples over all ranks)."""
    for position in range(len(steps[0])):
        actual = sum(m.label_tokens for rank_steps in steps for m in rank_steps[position].micro_batches)
        samples = sum(len(m.samples) for rank_steps in steps for m in rank_steps[position].micro_batches)
        for rank_steps in steps:
            assert rank_steps[position].num_label_tokens == actual
            assert rank_steps[position].num_samples == samples


def check_caps(steps: list[list[StepPlan]], max_tokens: int, max_patches: int | None = None) -> None:
    """I5: no packed micro-batch over the caps."""
    for rank_steps in steps:
        for s in rank_steps:
            for m in s.micro_batches:
                assert m.tokens <= max_tokens
                if max_patches is not None:
                    assert sum(x.patches for x in m.samples) <= max_patches


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))
