"""The test layers hold: tests/unit and tests/sim start no training process. A test that launches
(calls a helper of tests/launch.py marked ``@launches``, or runs launch/train.py itself) is found
by tests/conftest.py through its calls, nested functions, module helpers and fixtures, and marked
``e2e``; it belongs in tests/e2e. So ``pytest tests/unit tests/sim`` is the fast inner loop.

Oracles: pytest's own collection (run apart, as a user runs it) for the marking; the source of
the test modules (their import statements) for what they may use; and, for the detector itself,
small test modules whose launches are known by construction.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import COLLECTED_E2E, ROOT, _launching, launcher_of

TESTS = ROOT / "tests"
FAST = ("unit", "sim")


def _launch_helpers() -> set[str]:
    """The names of tests/launch.py's process-starting helpers, and of the trainer's path."""
    registered = importlib.import_module("launch").LAUNCHERS
    return {helper.__name__ for helper in registered} | {"TRAIN"}


def _e2e_in_this_session(config: pytest.Config) -> list[str] | None:
    """The e2e tests of tests/unit and tests/sim as this session collected them (tests/conftest.py
    keeps them, before -k/-m), if it collected all of both folders; else None."""
    if COLLECTED_E2E not in config.stash or any(
            config.getoption(name, default=None) for name in ("lf", "stepwise", "ignore", "ignore_glob")):
        return None
    here = config.invocation_params.dir
    paths = [(here / arg).resolve() for arg in config.args]
    if any("::" in arg for arg in config.args) or not all(
            any((TESTS / layer).is_relative_to(path) for path in paths) for layer in FAST):
        return None
    return [nodeid for nodeid in config.stash[COLLECTED_E2E] if nodeid.startswith(tuple(f"tests/{d}/" for d in FAST))]


def _e2e_apart() -> list[str]:
    """The e2e tests of tests/unit and tests/sim as pytest, run apart on both, collects them."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                 str(ROOT / ".torch_extensions"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", "-m", "e2e", *(f"tests/{d}" for d in FAST)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    # the collection ran (a module that fails to import is its own tests' failure)
    assert "deselected" in output, output[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith("ERROR")]


def test_no_test_collected_in_unit_or_sim_launches_a_process(request):
    """What the conftest marks e2e in tests/unit and tests/sim: nothing (read from this session's
    collection when it holds both folders, as ``pytest tests/unit tests/sim`` does; else from
    pytest run apart on them)."""
    launching = _e2e_in_this_session(request.config)
    if launching is None:
        launching = _e2e_apart()
    assert not launching, ("these tests start a process (tests/launch.py's helpers, or launch/train.py); "
                           f"move them to tests/e2e: {launching}")


def _imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) for each name that ``path`` imports (name '' for a whole module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def test_no_test_module_in_unit_or_sim_imports_a_launching_helper():
    helpers = _launch_helpers()
    assert {"deepspeed", "fsdp2", "plain", "deepspeed_watched", "Run"} <= helpers
    bad = []
    for layer in FAST:
        for path in sorted((TESTS / layer).rglob("*.py")):
            for line, module, name in _imports(path):
                if module in ("launch", "tests.launch") and (name in helpers or name in ("", "*")):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or '(the module)'}")
    assert not bad, f"tests/unit and tests/sim may not import what starts a process: {bad}"


def test_every_helper_of_launch_py_that_starts_a_process_is_registered():
    """A helper of tests/launch.py whose code starts a process (subprocess, multiprocessing, asyncio's
    subprocesses, os.exec*/spawn*/system/fork) is marked ``@launches``, so that the detector sees
    tests that call it."""
    tree = ast.parse((TESTS / "launch.py").read_text())

    def starts_a_process(call: ast.Call) -> bool:
        function = call.func
        if isinstance(function, ast.Name):
            return function.id in ("Popen", "Process")
        if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
            module, name = function.value.id, function.attr
            return module in ("subprocess", "multiprocessing", "asyncio") and name != "TimeoutExpired" or (
                module == "os" and name.startswith(("exec", "spawn", "posix_spawn", "system", "fork")))
        return False

    unregistered = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
        if "launches" not in decorators and any(isinstance(n, ast.Call) and starts_a_process(n)
                                                for n in ast.walk(node)):
            unregistered.append(node.name)
    assert not unregistered, f"tests/launch.py: mark these @launches: {unregistered}"


CASES = {
    "direct": ("from launch import deepspeed\n"
               "def test(tmp_path):\n    deepspeed(['--output_dir', str(tmp_path)])\n", "deepspeed"),
    "default script argument": ("from launch import fsdp2\n"
                                "def test():\n    fsdp2([], nproc=2)\n", "fsdp2"),
    "nested function": ("from launch import plain\n"
                        "def test():\n    def run():\n        return plain([])\n    assert run()\n", "plain"),
    "module helper": ("from launch import Run\n"
                      "def start(args):\n    return Run(args, nproc=2)\n"
                      "def test():\n    start([]).wait(10)\n", "Run"),
    "helper of a helper": ("from launch import deepspeed_watched\n"
                           "def inner():\n    return deepspeed_watched([])\n"
                           "def outer():\n    return inner()\n"
                           "def test():\n    outer()\n", "deepspeed_watched"),
    "module attribute": ("import launch as L\n"
                         "def test():\n    L.deepspeed([])\n", "deepspeed"),
    "held in a dict": ("from launch import deepspeed, fsdp2\n"
                       "BACKENDS = {'zero3': (deepspeed, 1), 'fsdp2': (fsdp2, 2)}\n"
                       "def test():\n    launch, _ = BACKENDS['fsdp2']\n    launch([])\n", None),
    "default argument": ("from launch import plain\n"
                         "def helper(run=plain):\n    return run([])\n"
                         "def test():\n    helper()\n", "plain"),
    "partial": ("import functools\nfrom launch import deepspeed\n"
                "ZERO3 = functools.partial(deepspeed, nproc=3)\n"
                "def test():\n    ZERO3([])\n", "deepspeed"),
    "the trainer's path": ("import subprocess, sys\nfrom launch import TRAIN\n"
                           "def own():\n    subprocess.run([sys.executable, str(TRAIN)])\n"
                           "def test():\n    own()\n", "train.py"),
    "no launch": ("from launch import ROOT, ds_config, free_port, odb_config\n"
                  "from conftest import check_caps\n"
                  "def test(tmp_path):\n    ds_config(tmp_path, 2), odb_config(tmp_path), free_port(), ROOT\n", ""),
}


def _module(source: str) -> dict:
    """``source`` run as a test module of tests/ (its code's file is in tests/, as the detector asks)."""
    namespace: dict = {"__name__": "layers_case"}
    exec(compile(textwrap.dedent(source), str(TESTS / "unit" / "layers_case.py"), "exec"), namespace)
    return namespace


def _name(found: object) -> str:
    return "" if found is None else getattr(found, "__name__", None) or Path(str(found)).name


def test_the_detector_follows_the_calls_of_a_test():
    for case, (source, expected) in CASES.items():
        found = _name(_launching([_module(source)["test"]]))
        assert found == expected or (expected is None and found), f"{case}: found {found!r}"


def test_the_detector_follows_fixtures_and_parameters():
    namespace = _module("from launch import deepspeed, free_port\n"
                        "def trained(tmp_path):\n    return deepspeed([str(tmp_path)])\n"
                        "def port():\n    return free_port()\n"
                        "def test(trained):\n    assert trained\n"
                        "def test_plain(port):\n    assert port\n")

    def item(function, fixtures, params=None):
        definitions = {name: [SimpleNamespace(func=namespace[name])] for name in fixtures}
        return SimpleNamespace(function=function, fixturenames=list(fixtures), cls=None,
                               _fixtureinfo=SimpleNamespace(name2fixturedefs=definitions),
                               callspec=SimpleNamespace(params=params or {}))

    assert _name(launcher_of(item(namespace["test"], ["trained"]))) == "deepspeed"
    assert launcher_of(item(namespace["test_plain"], ["port"])) is None
    launcher = importlib.import_module("launch").LAUNCHERS[0]
    assert launcher_of(item(namespace["test_plain"], ["port"], {"launch": launcher})) is launcher
