"""The floors stay floors: odb.batching (the pure core) imports neither torch nor the floors above it.

Each check runs in a fresh interpreter (this one has torch and odb.data loaded by other tests),
with torch blocked: ``sys.modules["torch"] = None`` makes any ``import torch`` raise.
"""

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


def test_every_core_module_is_found():
    assert {"odb.batching.batcher", "odb.batching.stream", "odb.batching.plan", "odb.batching.wire",
            "odb.batching.state", "odb.batching.align"} <= set(BATCHING)


@pytest.mark.parametrize("module", BATCHING)
def test_batching_module_imports_only_stdlib_numpy_and_its_own_floor(module):
    proc = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 0, f"importing {module} with torch blocked failed:\n{proc.stderr[-2000:]}"
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    above = [m for m in loaded["modules"] if m.startswith(ABOVE)]
    assert not above, f"{module} imports a floor above odb.batching: {above}"
    assert not loaded["outside"], f"{module} imports more than the stdlib and numpy: {loaded['outside']}"
