"""Shared test helpers (invariant checks over simulated ranks) and the test layers.

Every test is marked with its layer, the folder it lives in: ``unit``, ``sim``, ``dist`` or ``e2e``
(declared in pyproject.toml). A test that starts a process through tests/launch.py (it calls a
helper marked ``@launches`` there: ``deepspeed``, ``fsdp2``, ``plain``, ``Run``, ... directly,
through a helper of its module or a function nested in it, or through a fixture) is ``e2e``
wherever it lives, and so is one marked ``@pytest.mark.e2e`` by hand. Such tests live in
tests/e2e: tests/unit/test_layers_of_tests.py fails on one found in tests/unit or tests/sim. The
fast inner loop is ``pytest tests/unit tests/sim`` (or ``pytest -m "not e2e"``); ``pytest`` runs
every layer.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType, SimpleNamespace
from typing import TYPE_CHECKING

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from odb.batching.plan import StepPlan

LAYERS = ("unit", "sim", "proof", "dist", "e2e")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml): one test process per core, at most 4 and one per 4 GiB of free
    memory (a launch runs up to 3 ranks of about 0.6 GiB, the test's own oracle beside them): on the
    2-core CI machine, 2."""
    import psutil

    return max(1, min(_cores(), 4, psutil.virtual_memory().available // 2 ** 32))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_configure(config: pytest.Config) -> None:
    """A test process under xdist computes with its share of the cores (torch's intra-op threads):
    two test processes of two threads each on two cores made the fast loop's model tests up to 8x
    slower (OpenMP's threads spin while they wait for a core). Launched ranks set their own
    (OMP_NUM_THREADS=1, tests/launch.py)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, _cores() // workers))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tiny-model calls (the fuzzers): models this small gain nothing
    from a second thread, and on a shared machine its spinning OpenMP threads made each model call
    15x slower (measured here, load 5 on 2 cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_defaults():
    """The default files of launch/train.py, as it names them (for tests that call parse_config)."""
    from odb.training.launch.flags import FileDefaults

    return FileDefaults.bundled(ROOT)


def one_step_plan(micro_batches: Sequence[Sequence[dict]], *, padded: bool = False) -> StepPlan:
    """One rank's step over processed samples (``[]``: a dummy micro-batch), with the label tokens
    counted from the samples' own labels and their real tokens: what the batcher would plan."""
    from odb.batching.cost import SampleCost, count_label_tokens
    from odb.batching.plan import MicroBatch, StepPlan

    micros = tuple(MicroBatch(tuple(SampleCost(uid=i, tokens=len(s["input_ids"]), patches=0, cost=0,
                                               label_tokens=count_label_tokens(list(s.get("labels", s["input_ids"]))))
                                    for i, s in enumerate(micro)), padded=padded) for micro in micro_batches)
    return StepPlan(epoch=0, step=0, micro_batches=micros, num_label_tokens=sum(m.label_tokens for m in micros),
                    num_samples=sum(len(m.samples) for m in micros), rank_costs=tuple((0,) for _ in micros),
                    rank_tokens=tuple((m.tokens,) for m in micros))


def tool_module(name: str):
    """The tool ``tools/<folder>/<name>.py`` as a module (``tools.<folder>.<name>``): its
    ``main(argv)`` runs in this process."""
    import importlib

    (path,) = (ROOT / "tools").glob(f"*/{name}.py")
    return importlib.import_module(f"tools.{path.parent.name}.{name}")


@functools.cache
def bundled_tokenizer():
    """The bundled tokenizer (data/tokenizer), loaded once per test session."""
    from odb.training.model.build import load_tokenizer

    return load_tokenizer(ROOT / "data" / "tokenizer")


@pytest.fixture(scope="session")
def tokenizer():
    return bundled_tokenizer()


TESTS = Path(__file__).resolve().parent
_TRAINER = str(ROOT / "launch" / "train.py")  # (a str: the detector's own code must not look like a launch)


def _launches(value: object) -> bool:
    """A helper of tests/launch.py that starts a process (marked ``@launches`` there), or the
    trainer's path (a test's own helper that runs launch/train.py names it)."""
    if isinstance(value, Path):
        return str(value) == _TRAINER
    try:
        return getattr(value, "__launches__", False) is True
    except Exception:  # an object whose attribute access itself fails is no helper of ours
        return False


def _in_tests(value: object) -> bool:
    """Whether ``value`` (a function, class or module) is code of tests/ (whose calls are followed;
    odb's and the libraries' are not)."""
    code = getattr(value, "__code__", None)
    if code is not None:
        filename = code.co_filename
    else:
        module = value if inspect.ismodule(value) else sys.modules.get(getattr(value, "__module__", None) or "")
        filename = getattr(module, "__file__", None)
    return isinstance(filename, str) and _file_in_tests(filename)


@functools.lru_cache(maxsize=None)
def _file_in_tests(filename: str) -> bool:
    """Whether the source file ``filename`` is under tests/ (once per file: the layer marking asks
    it some 60,000 times over a collection)."""
    try:
        return Path(filename).resolve().is_relative_to(TESTS)
    except (OSError, ValueError):
        return False


def _launching(start: list[object], scope: type | None = None) -> object | None:
    """The first ``@launches`` helper (or launch/train.py's path) that the functions in ``start``
    reach, None if none does, following the calls of tests' own code: the names each function's
    code (and the functions nested in it) uses, resolved in its module (module-level helpers,
    classes, imported helpers, attributes of an imported test module, the helpers held in a
    module-level dict, list or tuple), its default arguments and closure, and the methods of
    ``scope`` (the test's class)."""
    stack, seen = list(start), set()
    while stack:
        value = stack.pop()
        if _launches(value):
            return value
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, functools.partial):
            stack.extend([value.func, *value.args, *value.keywords.values()])
            continue
        if isinstance(value, (dict, list, tuple, set, frozenset)):
            stack.extend(list(value.values() if isinstance(value, dict) else value)[:10_000])
            continue
        if isinstance(value, (staticmethod, classmethod, property)):
            stack.extend(f for f in (getattr(value, "__func__", None), getattr(value, "fget", None)) if f)
            continue
        if inspect.isclass(value):
            if _in_tests(value):
                stack.extend(vars(value).values())
            continue
        try:
            function = inspect.unwrap(value) if callable(value) else None
        except ValueError:
            continue
        code = getattr(function, "__code__", None)
        if code is None or not _in_tests(function):
            continue
        names, codes = set(), [code]
        while codes:
            c = codes.pop()
            names.update(c.co_names)
            codes.extend(k for k in c.co_consts if isinstance(k, CodeType))
        namespace = getattr(function, "__globals__", {})
        for name in names:
            if name in namespace:
                stack.append(namespace[name])
            if scope is not None and name in vars(scope):
                stack.append(vars(scope)[name])
        for module in [v for v in namespace.values() if inspect.ismodule(v) and _in_tests(v)]:
            stack.extend(getattr(module, name) for name in names if hasattr(module, name))
        stack.extend(function.__defaults__ or ())
        stack.extend((function.__kwdefaults__ or {}).values())
        for cell in function.__closure__ or ():
            try:
                stack.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                pass
    return None


def launcher_of(item: pytest.Item) -> object | None:
    """The ``@launches`` helper of tests/launch.py that the test ``item`` reaches: from its
    function, its parameters, or any fixture it uses (fixtures' own fixtures included); None if
    it starts no process that way."""
    function = getattr(item, "function", None)
    if function is None:
        return None
    start: list[object] = [function]
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        start.extend(definition.func for definition in definitions.get(name, ()))
    scope = getattr(item, "cls", None)
    # what a set of starts reaches is what each part reaches: the function and its fixtures are
    # followed once for all of a parametrized test's items, each item's parameters on their own
    key = (*map(id, start), id(scope))
    if key not in _REACHED.found:
        _REACHED.found[key] = (_launching(start, scope), start)  # (the starts kept: their ids stay theirs)
    found = _REACHED.found[key][0]
    callspec = getattr(item, "callspec", None)
    if found is None and callspec is not None:
        found = _launching(list(callspec.params.values()), scope)
    return found


_REACHED = SimpleNamespace(found={})
"""launcher_of's answers by starts. Held in an object the detector does not look into (it follows a
module-level dict's values: this one holds every test's helpers)."""


COLLECTED_E2E = pytest.StashKey[list[str]]()  # this session's collected e2e tests (before -k/-m deselect)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test with its layer: an explicit layer marker wins, then e2e for a test that
    starts a process through tests/launch.py (:func:`launcher_of`), then the folder under tests/.
    (Called before pytest's own -k/-m deselection: :data:`COLLECTED_E2E` keeps every e2e test
    collected, for tests/unit/test_layers_of_tests.py.)"""
    tests = Path(__file__).resolve().parent
    for item in items:
        layers = {layer for layer in LAYERS if item.get_closest_marker(layer)}
        if launcher_of(item) is not None:
            layers.add("e2e")
        if not layers:
            parts = item.path.resolve().relative_to(tests).parts
            if parts and parts[0] in LAYERS:
                layers.add(parts[0])
        for layer in sorted(layers):
            if not item.get_closest_marker(layer):
                item.add_marker(getattr(pytest.mark, layer))
    config.stash[COLLECTED_E2E] = [item.nodeid for item in items if item.get_closest_marker("e2e")]


def check_aligned(steps: list[list[StepPlan]]) -> None:
    """I1: every rank has the same steps and the same micro-batches per step."""
    shapes = [[(s.epoch, s.step, len(s.micro_batches)) for s in rank_steps] for rank_steps in steps]
    assert all(shape == shapes[0] for shape in shapes), "ranks are not aligned"


def check_exact_once(steps: list[list[StepPlan]], expected: Counter) -> None:
    """I2: the uids trained are exactly ``expected`` (no duplicates, nothing missing)."""
    trained = Counter(u for rank_steps in steps for s in rank_steps for m in s.micro_batches for u in m.uids)
    assert trained == expected, (f"missing {sorted((expected - trained).elements())[:10]}, "
                                 f"extra {sorted((trained - expected).elements())[:10]}")


def simulated_labels(lengths: Sequence[int | Sequence[int] | None]) -> Callable[[int], list[int]]:
    """The labels of a simulation's samples, by uid: ``lengths`` per dataset index as the test made
    them (a token count, ``(tokens, patches)``, or None for a record the data layer skips), each
    sample as :class:`~odb.batching.simulate.SimulatedFeed` describes it: every token a label (no
    prompt)."""
    sizes = [None if entry is None else entry if isinstance(entry, int) else entry[0] for entry in lengths]

    def labels(uid: int) -> list[int]:
        tokens = sizes[uid % len(sizes)]
        assert tokens is not None, f"uid {uid} is a record the data layer skips, yet it was planned"
        return [1] * tokens  # (any label but -100)

    return labels


def kept_label_tokens(labels: Sequence[int], max_tokens: int) -> int:
    """The label tokens a sample contributes to the loss as trained, from its own labels: its first
    ``max_tokens`` tokens (what the collate keeps of a longer one), every position of them but the
    first (masked: a packed sample's first token cannot be predicted from the sample before it),
    none of the -100s (the prompt)."""
    kept = list(labels)[:max_tokens]
    return sum(1 for label in kept[1:] if label != -100)


def check_label_tokens(steps: list[list[StepPlan]], labels_of: Callable[[int], Sequence[int]],
                       max_tokens: int) -> None:
    """I4: every rank's N_step equals the label tokens of that step over all ranks (and the step's
    sample count its samples over all ranks). The oracle is the samples themselves: each planned
    uid's labels (``labels_of(uid)``, e.g. :func:`simulated_labels`) cut to ``max_tokens`` and
    counted (:func:`kept_label_tokens`), not the cost model's records; each micro-batch's own
    count is checked against it too."""
    for position in range(len(steps[0])):
        expected, samples = 0, 0
        for rank, rank_steps in enumerate(steps):
            for m in rank_steps[position].micro_batches:
                counts = [kept_label_tokens(labels_of(uid), max_tokens) for uid in m.uids]
                assert m.label_tokens == sum(counts), (
                    f"rank {rank}, step {position}: a micro-batch of uids {m.uids} says {m.label_tokens} label "
                    f"tokens ({[x.label_tokens for x in m.samples]}), its samples hold {sum(counts)} ({counts})")
                expected += sum(counts)
                samples += len(m.uids)
        for rank, rank_steps in enumerate(steps):
            assert rank_steps[position].num_label_tokens == expected, (
                f"rank {rank}, step {position}: N_step {rank_steps[position].num_label_tokens}, the samples {expected}")
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


def run_to_state(make_batcher: Callable, world: int, stop_after: int) -> tuple[list[list], list[dict]]:
    """Simulated ranks, each with ``make_batcher(comm)``, stopped after ``stop_after`` steps (a
    checkpoint): the steps each trained, and each one's batcher state as a resume reads it."""
    from odb.batching.simulate import run_ranks

    def rank_main(comm):
        batcher = make_batcher(comm)
        steps = []
        for step in batcher:
            steps.append(step)
            if len(steps) == stop_after:
                break
        return steps, roundtrip(batcher.state_dict())

    out = run_ranks(world, rank_main)
    return [steps for steps, _ in out], [state for _, state in out]
