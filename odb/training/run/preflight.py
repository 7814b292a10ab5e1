"""Preflight: the run's worst-case step, measured before the first sample is read.

odb's caps are hard (I5: no micro-batch over ``max_tokens`` tokens or ``max_patches`` vision
patches), so one worst-case micro-batch bounds the memory of the whole run. Before any data is
consumed, every rank runs that micro-batch through the run's own model, backend (ZeRO stage or
FSDP2), gradient checkpointing, LoRA and loss path: one forward, backward and optimizer step of
synthetic tokens at the budget, in two shapes (one sample of ``max_tokens`` tokens, and the same
tokens packed as eight samples), plus, for a vision model, images of the largest size the run
admits and, where the run can train videos (the model's video processor, and a video token of its
own in the tokenizer: the data is read only later), a sample of the largest clips the budget holds
(:mod:`odb.training.run.worst_case`); under ``over_cap: sequence_parallel`` also a rank's slice of
the longest sample the largest group holds (``d x max_tokens`` tokens on ``d`` ranks: attention
over all of them for ``1/d`` of the heads, so ``d`` times the scores of a sample of ``max_tokens``),
trained as the run trains one. The step changes nothing (:meth:`odb.training.step.engine.OdbEngine.probe_step`: zero
gradients at learning rate 0), and afterwards the optimizer's state is reset to as built and the
random generators to where they were (:meth:`Backend.pristine`), so the run's first real step is
the one it would have been.

Each trial reports the step's peak memory (:func:`measure`: the device's peak allocation on a GPU,
the growth of the resident set on the CPU) and time; one gather agrees on the largest over the
ranks. A fixed budget that does not fit the cap (:func:`memory_cap_mb`: ``--memory_fraction`` of the
smallest rank's device memory, or ``--memory_limit_mb``) stops every rank with an error naming the
largest budget that does (searched downward); ``max_tokens: "auto"`` searches for that budget
(:func:`odb.training.run.budget.search_budget`) and trains with it. A step that runs out of device
memory stops the rank at once, naming the largest budget measured to fit; its peers hear of it
through the watchdog (:mod:`odb.training.run.watchdog`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from odb.batching.config import AUTO
from odb.batching.plan import Shared
from odb.data.media import video_token
from odb.training.backends import Backend
from odb.training.config.settings import RunConfig
from odb.training.model.build import hf_model
from odb.training.run.budget import QUANTUM, BudgetTrial, search_budget
from odb.training.run.worst_case import (
    WARMUP_TOKENS,
    special_token_ids,
    worst_case_batches,
    worst_images,
    worst_videos,
)
from odb.training.step.engine import OdbEngine
from odb.training.step.objectives import objective_of
from odb.training.step.sequence_parallel import SequenceParallel

__all__ = ["MAX_AUTO_TOKENS", "PreflightError", "PreflightReport", "local_ranks", "measure", "memory_cap_mb",
           "preflight", "run_preflight"]

MAX_AUTO_TOKENS = 131072
"""max_tokens auto searches up to this, or the model's context length (max_position_embeddings)
where shorter: one sample of the budget stays one the model was built for."""


def run_preflight(config: RunConfig, backend: Backend, comm, *, tokenizer, vision, packed: bool, world_size: int,
                  log: Callable[[str], None], sequence_parallel: SequenceParallel | None = None,
                  groups: dict[int, SequenceParallel] | None = None, rank: int = 0) -> PreflightReport:
    """The worst-case step at the run's budget, or the search for one (``max_tokens`` 'auto'), on
    the run's own engine (collective; :mod:`odb.training.run.preflight`). The optimizer's state and the
    random generators are left as they were. Under sequence parallelism a budget is a rank's: the
    step's row holds S times it, split over the group. ``groups``: under over_cap
    'sequence_parallel', this rank's (``rank``) group of each size; the largest trains the slices
    of a long sample too."""
    group = sequence_parallel.size if sequence_parallel is not None else 1
    groups = groups or {}
    model, batching = hf_model(backend.module), config.batching
    engines: dict[int, OdbEngine] = {}
    objective = objective_of(config)  # (its probe: a reward model's scores, else next-token loss)
    vocab_size = min(len(tokenizer), model.get_input_embeddings().num_embeddings)
    avoid = special_token_ids(model.config)

    # with GAS > 1 the step's last micro-batch runs over what the earlier ones accumulated unreduced
    # (FSDP2 without reduce_every_micro_batch: every rank's whole fp32 gradients): one small one first
    accumulates = batching.gas > 1 or batching.global_batch_tokens is not None  # (gas derived after this)
    earlier = worst_case_batches(WARMUP_TOKENS, vocab_size=vocab_size, avoid=avoid)[0] if accumulates else None

    def step(samples: list[dict[str, Any]], budget: int, degree: int = 1) -> None:
        if budget not in engines:  # (its loss chunks are those of a run at this budget)
            engines[budget] = OdbEngine(backend, world_size=world_size, max_tokens=budget,
                                        pad_token_id=tokenizer.pad_token_id, packed=packed,
                                        loss_chunk_tokens=None if config.objective.scores
                                        else config.model.loss_chunk_tokens, objective=objective,
                                        sequence_parallel=sequence_parallel, groups=groups, rank=rank)
        shared = None
        if degree > 1:  # the group's first rank holds the long sample and sends it, as a run's owner does
            owner = rank - rank % degree
            shared = Shared(owner=owner, degree=degree, tokens=len(samples[0]["input_ids"]))
            samples = samples if rank == owner else []
        engines[budget].probe_step(samples, earlier=earlier, shared=shared)

    visual = None
    if vision is not None:
        largest = vision.max_pixels // vision.patch_size ** 2
        cap = None if batching.max_patches in (None, AUTO) else batching.max_patches
        videos = vision.video if vision.video is not None and video_token(tokenizer, vision)[0] is not None else None
        if videos is not None:
            log("odb: preflight: the model takes videos: the worst case holds the largest clips its video processor "
                "makes, as many as the budget holds, beside the images")

        def visual(budget: int) -> list[dict[str, Any]]:
            clips = None if videos is None else worst_videos(
                model.config, videos, budget, max_patches=cap,
                text_ids=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
            images = worst_images(model.config, budget, largest_image=largest, max_patches=cap)
            return [images] if clips is None else [images, clips]
    long = max(groups, default=1)
    if long > 1:
        log(f"odb: preflight: over_cap sequence_parallel: the worst case holds a rank's slice of a sample of {long} x "
            f"max_tokens, trained on a group of {long} ranks")
    text = getattr(model.config, "text_config", None) or model.config
    upper = min(MAX_AUTO_TOKENS, (getattr(text, "max_position_embeddings", None) or MAX_AUTO_TOKENS) // group)
    settings = config.preflight
    cap_mb = memory_cap_mb(backend.device, fraction=settings.memory_fraction, limit_mb=settings.memory_limit_mb,
                           local_ranks=local_ranks())
    backend.train(True)
    with backend.pristine():
        report = preflight(step, budget=batching.max_tokens, upper=upper, gather=comm.all_gather,
                           device=backend.device, cap_mb=cap_mb, world_size=world_size, vocab_size=vocab_size,
                           avoid=avoid, visual=visual, log=log, group=group, long=long)
    if backend.device.type == "cuda":  # the run's own peak (summary.json) starts here
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(backend.device)
    chosen = " (auto)" if batching.max_tokens == AUTO else ""
    log(f"odb: preflight: max_tokens {report.max_tokens}{chosen}: worst-case step peaks at {report.peak_mb:.0f} MB "
        f"of {report.limit_mb:.0f} MB ({report.device}), {report.step_s:.2f} s, about {report.tokens_per_s:.0f} "
        f"tokens/s over {world_size} ranks at the worst case; {len(report.trials)} trial(s), {report.seconds:.1f} s")
    return report


class PreflightError(RuntimeError):
    """The worst-case step does not fit; the message names the largest budget that does."""


@dataclass
class PreflightReport:
    """What the preflight measured (``summary.json``'s ``preflight``)."""

    max_tokens: int
    """The budget the run trains with (the one chosen where it was ``auto``)."""
    max_patches: int | None
    """The vision patches of the worst-case image (None: a text model)."""
    peak_mb: float
    """The worst-case step's peak memory at that budget, the largest over the ranks (GPU: the
    device memory allocated; CPU: the growth of the resident set during the step)."""
    limit_mb: float
    """The cap the peak is held to."""
    trials: list[dict[str, Any]]
    """Every budget tried: ``{"max_tokens", "peak_mb", "fits", "step_s"}``."""
    step_s: float
    """The worst-case step's time at the chosen budget (the slowest shape, the slowest rank)."""
    seconds: float
    """The whole preflight's time, trials and warm-up step included."""
    tokens_per_s: float
    """All ranks' tokens per second at the worst case: ``world_size * max_tokens / step_s``."""
    device: str
    """'cuda' or 'cpu': what ``peak_mb`` measures."""
    collectives: int = 0
    """odb's gathers it took (one for the cap, one per trial): not among the run's ``odb_collectives``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the memory probe -------------------------------------------------------------------------

def _proc_kb(path: str, field: str) -> int:
    """A ``Field:  N kB`` line of a /proc file (``/proc/self/status``, ``/proc/meminfo``)."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{path} has no {field}")
    return int(match.group(1))


def measure(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """``(peak_mb, seconds)`` of ``step()``: on a GPU the device memory allocated at the step's
    peak (weights, optimizer state and activations: what the cap is a share of); on the CPU how
    much the process's resident set grew during the step (Linux: its high-water mark reset through
    ``/proc/self/clear_refs`` before the step, after the C allocator returned what earlier steps
    freed). Raises what the step raises (out of memory)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20, time.perf_counter() - began
    _trim()  # what an earlier, larger step freed goes back to the system: it would hide this step's growth
    before = _proc_kb("/proc/self/status", "VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark (VmHWM) starts again from here
    began = time.perf_counter()
    step()
    seconds = time.perf_counter() - began
    return max(0.0, (_proc_kb("/proc/self/status", "VmHWM") - before) / 1024), seconds


def _trim() -> None:
    """glibc keeps freed heap memory for reuse; ``malloc_trim`` hands it back (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_cap_mb(device: torch.device, *, fraction: float, limit_mb: int | None, local_ranks: int) -> float:
    """The cap of this rank's worst-case step: ``fraction`` of the device's memory (GPU), or of
    the memory the machine has available shared by its ``local_ranks`` (CPU), and at most
    ``limit_mb`` where given."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1] / 2**20
    else:
        total = _proc_kb("/proc/meminfo", "MemAvailable") / 1024 / max(1, local_ranks)
    cap = fraction * total
    return min(cap, float(limit_mb)) if limit_mb is not None else cap


# ---- the preflight ----------------------------------------------------------------------------

@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """The random generators (dropout's) as they were, after whatever runs inside."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def preflight(step: Callable[[list[dict[str, Any]], int], None], *, budget: int | str, upper: int,
              gather: Callable[[np.ndarray], np.ndarray], device: torch.device, cap_mb: float, world_size: int,
              vocab_size: int, avoid: set[int], visual: Callable[[int], list[dict[str, Any]]] | None = None,
              log: Callable[[str], None] = print, max_trials: int = 16, group: int = 1, long: int = 1
              ) -> PreflightReport:
    """Measures the worst-case step at ``budget`` (an int), or searches for the largest that fits
    (``"auto"``, up to ``upper``), on every rank in lockstep (collective: one ``gather`` for the cap
    and one per trial).

    Args:
        step: runs one micro-batch of the given samples at the given budget through the run's
            engine (:meth:`OdbEngine.probe_step`); called inside the caller's :meth:`Backend.pristine`.
            ``step(samples, budget, degree)`` (``long`` only): ``samples`` is one long sample, of
            which this rank trains its slice on its group of ``degree`` ranks.
        gather: all ranks' int64 vectors (odb's gloo communicator).
        cap_mb: this rank's cap (:func:`memory_cap_mb`); the smallest over the ranks holds.
        visual: a vision model's ``visual(budget)``: its worst-case image and video samples at a
            budget (:func:`worst_images`, :func:`worst_videos`), each a shape of its own.
        group: sequence parallelism's S: a budget is a rank's, and ``step`` gets rows of S times it
            (and that as its budget), which the S ranks of a group split.
        long: under over_cap 'sequence_parallel', the largest group's size d (1: none): each trial
            also runs a sample of d times the budget, this rank's slice of it (``step(sample, budget, d)``).

    Raises:
        PreflightError: a fixed budget over the cap (naming the largest under it), no budget fits,
            or the step ran out of device memory.
    """
    began = time.perf_counter()
    cap = float(gather(np.array([int(cap_mb * 1024)], dtype=np.int64)).min()) / 1024
    patches: dict[int, int | None] = {}
    times: dict[int, float] = {}
    fits: set[int] = set()
    gathered: list[int] = []  # the budgets of the trials' gathers

    def trial(tokens: int) -> float:
        media = visual(tokens) if visual is not None else []
        patches[tokens] = max((int(sample["patches"]) for sample in media), default=None)
        shapes = [(lambda b=batch: step(b, tokens * group)) for batch in
                  worst_case_batches(tokens * group, vocab_size=vocab_size, avoid=avoid, visual=media)]
        if long > 1:  # the longest sample the largest group holds, this rank's slice of it
            sample = worst_case_batches(tokens * long, vocab_size=vocab_size, avoid=avoid)[0]
            shapes.append(lambda: step(sample, tokens, long))
        peak = seconds = 0.0
        for shape in shapes:
            try:
                used, took = measure(shape, device)
            except torch.OutOfMemoryError as err:
                best = max(fits) if fits else None
                fix = (f"the largest budget measured to fit is {best}: set max_tokens {best} or lower" if best else
                       "no budget was measured to fit: lower max_tokens, or train with LoRA, gradient checkpointing "
                       "or a higher ZeRO stage")
                hint = "" if budget == "auto" else ", or max_tokens auto"
                raise PreflightError(f"the worst-case step at max_tokens {tokens} ran out of device memory on this "
                                     f"rank ({err}); {fix}{hint}") from err
            peak, seconds = max(peak, used), max(seconds, took)
        agreed = gather(np.array([int(peak * 1024), int(seconds * 1e6)], dtype=np.int64))
        gathered.append(tokens)
        peak, times[tokens] = float(agreed[:, 0].max()) / 1024, float(agreed[:, 1].max()) / 1e6
        if peak <= cap:
            fits.add(tokens)
        shown = f" ({patches[tokens]} patches)" if patches[tokens] else ""
        log(f"odb: preflight: max_tokens {tokens}{shown}: peak {peak:.0f} MB of {cap:.0f} MB, "
            f"{times[tokens]:.2f} s{'' if peak <= cap else ' (over)'}")
        return peak

    with _rng_kept():
        warm = min(WARMUP_TOKENS, upper)
        step(worst_case_batches(warm, vocab_size=vocab_size, avoid=avoid)[0], warm)  # allocates the optimizer state
        if budget == "auto":
            chosen, trials = search_budget(trial, cap, upper=upper, start=min(upper, 4096), max_trials=max_trials)
            if chosen is None:
                raise PreflightError(f"no budget fits the cap of {cap:.0f} MB, not even max_tokens {QUANTUM} "
                                     f"({trials[-1].peak:.0f} MB): raise --memory_limit_mb or --memory_fraction, "
                                     "or train with LoRA, gradient checkpointing or a higher ZeRO stage")
        else:
            assert isinstance(budget, int)
            peak = trial(budget)
            trials = [BudgetTrial(budget, peak, budget in fits)]
            if budget not in fits:
                best = None
                if budget > QUANTUM:
                    best, more = search_budget(trial, cap, upper=budget - 1, start=budget // 2, max_trials=max_trials)
                    trials += more
                fix = (f"set max_tokens {best} (the largest that fits) or auto" if best else
                       "no smaller budget fits either: train with LoRA, gradient checkpointing or a higher ZeRO stage")
                raise PreflightError(
                    f"the worst-case micro-batch at max_tokens {budget} peaks at {trials[0].peak:.0f} MB, over the "
                    f"cap of {cap:.0f} MB (--memory_fraction of the device's memory, or --memory_limit_mb): {fix}; "
                    "or raise the cap, or skip the check with --preflight off")
            chosen = budget
    return PreflightReport(
        max_tokens=chosen, max_patches=patches.get(chosen),
        peak_mb=round(next(t.peak for t in reversed(trials) if t.budget == chosen), 1), limit_mb=round(cap, 1),
        trials=[{"max_tokens": t.budget, "peak_mb": round(t.peak, 1), "fits": t.fits,
                 "step_s": round(times[t.budget], 4)} for t in trials],
        step_s=round(times[chosen], 4), seconds=round(time.perf_counter() - began, 2),
        tokens_per_s=round(world_size * chosen / times[chosen], 1) if times[chosen] else 0.0, device=device.type,
        collectives=1 + len(gathered))


def local_ranks() -> int:
    """Ranks on this machine: torchrun's and srun's LOCAL_WORLD_SIZE, DeepSpeed's runner's
    LOCAL_SIZE, else WORLD_SIZE (1 without a launcher)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return max(1, int(os.environ[name]))
    return 1
