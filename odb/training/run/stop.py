"""The stop on request: SIGTERM or SIGUSR1 -> every rank stops after the same step, saves and exits 75.

:class:`GracefulStop` (SIGTERM or SIGUSR1, e.g. SLURM's ``--signal=TERM@120`` or ``scancel``).
The handler only sets a flag. At its next step boundary the signalled rank proposes "stop once
``k + 2`` steps are done" (``k``: its steps done) through the store's ``compare_set``, so the
first proposal wins; every rank reads the key at every step boundary. Why ``k + 2`` reaches every
rank in time: every step has a collective that needs every rank (ZeRO's reduction at the
accumulation boundary, at any stage), so no rank can finish step ``k`` (its ``k + 1``-th) before
the proposer has written the key and joined that step, and every rank then reads the key at a
boundary before its ``k + 2``-th step is done. All ranks stop after the same step, save a
checkpoint and exit with :data:`EXIT_PREEMPTED`; ``--resume`` continues exactly. No collective
is added: one store lookup per step.

Like the watchdog (:mod:`odb.training.run.watchdog`) it rides on the rendezvous store, under
this attempt's keys, never on the model's collectives.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["EXIT_PREEMPTED", "GracefulStop", "Preempted"]

EXIT_PREEMPTED = 75
"""Exit code after SIGTERM / SIGUSR1: a checkpoint was saved; ``--resume`` continues (EX_TEMPFAIL)."""


_STOP = "odb/stop_after_steps"  # (under this attempt's prefix: connect_store)


class Preempted(Exception):  # noqa: N818 - not an error: the run stopped as asked
    """Raised by the train loop once every rank has stopped at the agreed step and saved."""

    def __init__(self, steps_done: int, tag: str) -> None:
        super().__init__(f"stopped on request after {steps_done} steps; checkpoint {tag} saved "
                         f"(exit code {EXIT_PREEMPTED}): continue with --resume")
        self.steps_done, self.tag = steps_done, tag


class GracefulStop:
    """SIGTERM / SIGUSR1 -> every rank stops after the same step (the module docstring has why).

    Args:
        store: a store client used only by the main thread (:func:`connect_store`).
        rank: this rank.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, store, *, rank: int) -> None:
        self.store, self.rank = store, rank
        self.signal: str | None = None  # the signal received, if any
        self.stop_after: int | None = None  # the agreed number of steps, once known
        self._proposed = False

    def install(self) -> GracefulStop:
        """Handles SIGTERM and SIGUSR1 in this process from now on (call from the main thread)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            _log(f"odb: rank {self.rank} received {name}: every rank stops at a step boundary soon, saves a "
                 f"checkpoint and exits with code {EXIT_PREEMPTED}")
        self.signal = self.signal or name

    def ignore_further_signals(self) -> None:
        """Once this rank stops (``should_stop`` said so): from now on SIGTERM and SIGUSR1 are ignored, up to
        the process's very end. Under ``srun --kill-on-bad-exit`` the first rank to exit 75 makes SLURM
        send SIGTERM to the others while they finish their own exit; with a Python handler that
        SIGTERM still kills a rank during interpreter shutdown (Python restores the default handler
        there) and the job reports 143 instead of 75. ``SIG_IGN`` survives that; SIGKILL after
        SLURM's KillWait still bounds the exit."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def should_stop(self, steps_done: int) -> bool:
        """Called by every rank after each step (``steps_done``: steps completed): whether to stop now."""
        if self.signal is not None and not self._proposed:
            agreed = self.store.compare_set(_STOP, "", str(steps_done + 2))
            self.stop_after, self._proposed = int(agreed), True
        elif self.stop_after is None and self.store.check([_STOP]):
            self.stop_after = int(self.store.get(_STOP))
        stopping = self.stop_after is not None and steps_done >= self.stop_after
        if stopping:
            self.ignore_further_signals()  # a rank that is already stopping must not die of a later signal
        return stopping


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
