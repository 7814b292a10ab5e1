"""The run behind ``launch/train.py``: init -> build -> train -> finish, and shutdown.

    loop.py         :class:`~odb.training.run.loop.Trainer`: one rank of a run, its step loop, finish and shutdown
    assemble.py     the process group, then every component in the same order on every rank
    datasets.py     the training and validation datasets, a streaming source's reader
    preflight.py    the worst-case step at the budget, or the search for one (``max_tokens auto``)
    budget.py       the budget search itself; worst_case.py: the micro-batches it measures
    checkpoint.py   the backend's checkpoint and odb's state files, one tag folder per save
    evaluate.py     the exact validation loss on packed, aligned micro-batches
    schedule.py     the learning rate by progress
    startup.py      the checks before any process group; waits.py: waits that announce themselves
    watchdog.py     no hang: a dead or frozen rank is named and every rank ends
    stop.py         SIGTERM / SIGUSR1: every rank stops after the same step and saves
    progress.py     rank 0's bar or lines; teardown.py: the process's end
"""

from odb.imports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {"loop": ("Trainer",)})
