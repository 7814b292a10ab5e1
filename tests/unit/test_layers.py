"""The floors stay floors: odb.batching (the pure core) imports neither torch nor the floors above it.

Each check runs in a fresh interpreter (this one has torch and odb.data loaded by other tests),
with torch blocked: ``sys.modules["torch"] = None`` makes any ``import torch`` raise.
"""

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BATCHING = [f"odb.batching.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "odb" / "batching")])]
ABOVE = ("odb.data", "odb.training", "odb.telemetry")

PROBE = """
import importlib, json, sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
before = set(sys.modules)
importlib.import_module(sys.argv[1])
added = sorted(name for name in set(sys.modules) - before if sys.modules[name] is not None)
tops = {name.split(".")[0] for name in added if not name.startswith("_sysconfigdata")}  # stdlib data
outside = sorted(tops - set(sys.stdlib_module_names) - {"odb", "numpy"})
print(json.dumps({"modules": added, "outside": outside}))
"""


TORCH_FREE = ("odb.settings", "odb.telemetry", "odb.data.formats", "odb.data.preference", "odb.data.labels",
              "odb.data.sources", "odb.data.config", "odb.data.mixture")
"""Modules above the core that need no torch either: the settings plumbing, the run's metrics, and
the record formats (preference records too), labels and sources (tools and tests use them without a model)."""


def probe(module: str) -> dict:
    """What importing ``module`` in a fresh interpreter with torch blocked loads (it must import)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 0, f"importing {module} with torch blocked failed:\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_module_imports_no_torch_and_nothing_above_it(module):
    loaded = probe(module)
    assert not [m for m in loaded["modules"] if m.startswith("odb.training")], f"{module} imports odb.training"
    assert not loaded["outside"], f"{module} imports more than the stdlib and numpy: {loaded['outside']}"


def test_every_core_module_is_found():
    assert {"odb.batching.batcher", "odb.batching.stream", "odb.batching.decide", "odb.batching.wire",
            "odb.batching.state", "odb.batching.align"} <= set(BATCHING)


@pytest.mark.parametrize("module", BATCHING)
def test_batching_module_imports_only_stdlib_numpy_and_its_own_floor(module):
    loaded = probe(module)
    above = [m for m in loaded["modules"] if m.startswith(ABOVE)]
    assert not above, f"{module} imports a floor above odb.batching: {above}"
    assert not loaded["outside"], f"{module} imports more than the stdlib and numpy: {loaded['outside']}"


# ---- the backends own everything backend-specific -------------------------------------------------

BACKEND_APIS = ("deepspeed", "torch.distributed.fsdp", "torch.distributed.checkpoint")
"""What only ``odb/training/backends/`` may import: DeepSpeed, FSDP2 and its checkpoint format."""


def _outside_backends() -> list[Path]:
    backends = ROOT / "odb" / "training" / "backends"
    return sorted(p for p in (ROOT / "odb").rglob("*.py") if backends not in p.parents)


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` names, at any depth (function-local ones too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, node.module), *((node.lineno, f"{node.module}.{a.name}") for a in node.names)]
    return found


def test_only_the_backends_import_deepspeed_or_fsdp2():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in _outside_backends()
             for line, name in _imported(ast.parse(path.read_text()))
             if any(name == api or name.startswith(api + ".") for api in BACKEND_APIS)]
    assert not wrong, "backend-specific imports outside odb/training/backends/:\n" + "\n".join(wrong)


def test_no_module_outside_the_backends_branches_on_a_backend_name():
    from odb.training.backends import NAMES

    wrong = []
    for path in _outside_backends():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                if any(c.value in NAMES for c in constants):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, "comparisons with a backend's name outside odb/training/backends/: " + ", ".join(wrong)


def test_the_checker_sees_a_local_import_and_a_branch(tmp_path):
    tree = ast.parse("def f(b):\n    from deepspeed.utils import x\n    return b == 'fsdp2'\n")
    assert (2, "deepspeed.utils") in _imported(tree)
    assert any(isinstance(n, ast.Compare) and n.comparators[0].value == "fsdp2" for n in ast.walk(tree))


# ---- the rooms of odb/training, each using only those below it -----------------------------------

TRAINING_FLOORS = (("config", "attention"), ("model",), ("backends",), ("step",), ("export", "check_media"), ("run",),
                   ("launch", "check_model"))
"""odb/training's folders (and its top-level modules) from the bottom up, as odb/training/__init__.py
draws them: a module may import its own room's, and those of the floors below."""
MAX_MODULE_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_time_imports(path: Path) -> set[str]:
    """The odb modules ``path`` imports at run time, at any depth, type-checking-only imports left out
    (a ``from package import submodule`` names the submodule)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.startswith("odb"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if (ROOT / Path(*sub.split("."))).with_suffix(".py").exists()
                          or (ROOT / Path(*sub.split("."))).is_dir() else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("odb")}
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _run_time_imports(p) for p in sorted((ROOT / "odb").rglob("*.py"))}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["odb", "training"] and len(parts) > 2 else None


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(TRAINING_FLOORS) if room in rooms)


def test_every_room_of_training_has_a_floor():
    rooms = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "odb" / "training").iterdir()
             if p.name != "__init__.py" and p.name != "__pycache__"}
    assert rooms == {room for floor in TRAINING_FLOORS for room in floor}


def test_training_rooms_import_only_their_own_and_the_floors_below():
    wrong = [f"{module} -> {target}" for module, targets in _graph().items() if _room(module)
             for target in targets if _room(target) and _room(target) != _room(module)
             and _floor(_room(target)) >= _floor(_room(module))]
    assert not wrong, "imports of a room on the same floor or above:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_itself_in_a_circle():
    graph = _graph()
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target == module or target not in graph or target in ("odb", "odb.training"):
                continue  # (a package's __init__ re-exports: odb's own finder and version only)
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checkers_see_a_back_arrow_and_a_circle(tmp_path):
    assert _floor("step") > _floor("backends") > _floor("model") > _floor("config")
    tree = tmp_path / "m.py"
    tree.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from odb.training.run import loop\n"
                    "def f():\n    from odb.training.step.engine import OdbEngine\n")
    assert _run_time_imports(tree) == {"odb.training.step.engine"}


def test_no_module_is_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "odb").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


BEFORE_THE_RECUT = {
    "odb.training.config": ("odb.training.config.settings", ["CheckpointSettings", "DataSettings", "LoggingSettings",
                            "ModelSettings", "PreflightSettings", "RunConfig", "RunSettings"]),
    "odb.training.model": ("odb.training.model.build", ["build_model", "load_tokenizer", "hf_model", "vision_spec"]),
    "odb.training.run": ("odb.training.run.loop", ["Trainer"]),
}
"""Names the docs imported from these paths when they were modules; they still import from there."""


@pytest.mark.parametrize("package", BEFORE_THE_RECUT)
def test_names_of_the_modules_before_the_recut_still_import_from_their_package(package):
    home, names = BEFORE_THE_RECUT[package]
    for name in names:
        got = getattr(importlib.import_module(package), name)
        assert got is getattr(importlib.import_module(home), name), f"{package}.{name}"
    with pytest.raises(AttributeError, match="no attribute 'Nonesuch'"):
        getattr(importlib.import_module(package), "Nonesuch")


def test_a_light_module_of_a_package_with_lazy_names_stays_light():
    loaded = probe("odb.training.config.environment")["modules"]
    assert "odb.training.config.environment" in loaded
    assert "odb.training.config.settings" not in loaded
