"""Each micro-batch's forward time on this rank (:class:`ForwardClock`): what the cost fit and the
measured sync efficiency read of a rank's work."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["ForwardClock"]


class ForwardClock:
    """The time of each micro-batch's forward pass on this rank: the cost fit's and the measured
    sync efficiency's measure of a rank's work. The forward, not the backward: a backward ends in
    the gradient reduction (ZeRO-2's every micro-batch, the step's last one on every backend),
    where a rank that finished early waits for the slowest, so its time would read the slowest
    rank's. (Under ZeRO-3 and FSDP2 the forward still waits for each layer's parameter gather.)
    On a GPU the marks are CUDA events on the compute stream, read after the step (no host sync
    per micro-batch); on another accelerator the device is synchronized at each mark; on the CPU,
    the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self._began: Any = None

    def _now(self) -> Any:
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._began = self._now()

    def stop(self) -> None:
        self.spans.append((self._began, self._now()))

    def seconds(self) -> tuple[float, ...]:
        """Each span's seconds (on CUDA once the last has run on the device)."""
        if not self.is_cuda:
            return tuple(end - begin for begin, end in self.spans)
        if self.spans:
            self.spans[-1][1].synchronize()
        return tuple(begin.elapsed_time(end) / 1e3 for begin, end in self.spans)
