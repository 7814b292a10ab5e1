"""end_process (odb/training/run/teardown.py), the last call of launch/train.py after a clean shutdown: it
keeps what the interpreter's own exit does for the run (other threads and idle executor workers
waited for, exit handlers run, Python's and C's buffered output written, the exit code) and
skips only the modules' teardown. The oracle is what the same child process leaves when it ends
with sys.exit instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT

CHILD = textwrap.dedent("""
    import atexit, sys, tempfile, threading, time
    from pathlib import Path
    from odb.training.run.teardown import end_process  # (torch and all: imported before the clock below starts)
    out, how = Path(sys.argv[1]), sys.argv[2]
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    keep = tempfile.TemporaryDirectory(dir=out)  # removed by its finalizer at exit
    (out / "tempdir").write_text(keep.name)

    def late():
        time.sleep(0.5)
        (out / "thread").write_text("done")

    threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(2)  # idle workers, stopped by threading's exit hooks (or the exit hangs)
    pool.submit(lambda: None).result()
    import ctypes
    ctypes.CDLL(None).printf(b"from C, ")  # C stdio, buffered: a pipe is not a terminal
    sys.stdout.write("buffered, no newline")
    if how == "end_process":
        end_process(3)
    sys.exit(3)
""")


@pytest.mark.parametrize("how", ["sys.exit", "end_process"])
def test_end_process_keeps_what_the_interpreters_exit_does_for_the_run(tmp_path, how):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), how], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 3, proc.stderr[-2000:]
    # both buffers written (in an order that is not the point: each side's own buffer)
    assert sorted([proc.stdout.replace("from C, ", ""), proc.stdout.replace("buffered, no newline", "")]) == \
        ["buffered, no newline", "from C, "], proc.stdout
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"
    assert not Path((tmp_path / "tempdir").read_text()).exists()
