"""Preflight: the run's worst-case step, measured before the first sample is read.

odb's caps are hard (I5: no micro-batch over ``max_tokens`` tokens or ``max_patches`` vision
patches), so one worst-case micro-batch bounds the memory of the whole run. Before any data is
consumed, every rank runs that micro-batch through the run's own model, backend (ZeRO stage or
FSDP2), gradient checkpointing, LoRA and loss path: one forward, backward and optimizer step of
synthetic tokens at the budget, in two shapes (one sample of ``max_tokens`` tokens, and the same
tokens packed as eight samples), plus, for a vision model, an image of the largest size the run
admits. The step changes nothing (:meth:`odb.training.engine.OdbEngine.probe_step`: zero
gradients at learning rate 0), and afterwards the optimizer's state is reset to as built and the
random generators to where they were (:meth:`Backend.pristine`), so the run's first real step is
the one it would have been.

Each trial reports the step's peak memory (:func:`measure`: the device's peak allocation on a GPU,
the growth of the resident set on the CPU) and time; one gather agrees on the largest over the
ranks. A fixed budget that does not fit the cap (:func:`memory_cap_mb`: ``--memory_fraction`` of the
smallest rank's device memory, or ``--memory_limit_mb``) stops every rank with an error naming the
largest budget that does (searched downward); ``max_tokens: "auto"`` searches for that budget
(:func:`odb.training.budget.search_budget`) and trains with it. A step that runs out of device
memory stops the rank at once, naming the largest budget measured to fit; its peers hear of it
through the watchdog (:mod:`odb.training.faults`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from odb.training.budget import QUANTUM, BudgetTrial, search_budget

__all__ = ["PACKED_SAMPLES", "PreflightError", "PreflightReport", "image_sample", "local_ranks", "measure",
           "memory_cap_mb", "preflight", "special_token_ids", "worst_case_batches", "worst_images"]

PACKED_SAMPLES = 8
"""The packed shape's samples per micro-batch (the budget's tokens in equal parts)."""
WARMUP_TOKENS = QUANTUM
"""The first step's size: it allocates the optimizer's state, so the measured trials see it resident,
as every step of the run does."""


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


# ---- the worst-case micro-batches ---------------------------------------------------------------

def worst_case_batches(budget: int, *, vocab_size: int, avoid: set[int], image: dict[str, Any] | None = None
                       ) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches of a budget: one sample of ``budget`` tokens, and ``budget`` tokens as
    :data:`PACKED_SAMPLES` samples (fewer if the budget is small); every label counts. Token ids
    are seeded and never one of ``avoid`` (a model's image, video or vision start/end tokens).
    ``image``: a vision model's worst-case image sample (:func:`image_sample`), which then opens
    the one-sample shape (its tokens out of the budget's)."""
    generator = torch.Generator().manual_seed(budget)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in avoid])

    def text(tokens: int) -> dict[str, torch.Tensor]:
        ids = allowed[torch.randint(len(allowed), (tokens,), generator=generator)]
        return {"input_ids": ids, "labels": ids.clone()}

    parts = min(PACKED_SAMPLES, budget)
    packed = [text(budget // parts + (1 if i < budget % parts else 0)) for i in range(parts)]
    if image is None:
        return [[text(budget)], packed]
    rest = budget - len(image["input_ids"])
    one = [{**image, "input_ids": torch.cat([image["input_ids"], text(rest)["input_ids"]]) if rest > 0
            else image["input_ids"]}]
    one[0]["labels"] = torch.cat([image["labels"], one[0]["input_ids"][len(image["labels"]):]])
    return [one, packed]


def image_sample(model_config, *, image_patches: int, images: int = 1) -> dict[str, torch.Tensor]:
    """A sample of ``images`` images, each about ``image_patches`` vision patches (a grid of whole
    merged tokens, as square as it goes) between the vision start and end tokens, its labels all
    -100; ``sample["patches"]`` is the patch count."""
    spec, merge = model_config.vision_config, model_config.vision_config.spatial_merge_size
    tokens = max(1, image_patches // (merge * merge))
    rows = max(1, math.isqrt(tokens))
    cols = max(1, tokens // rows)
    grid = torch.tensor([[1, rows * merge, cols * merge]] * max(1, images))
    count = int(grid.prod(dim=1).sum())
    width = spec.in_channels * spec.temporal_patch_size * spec.patch_size ** 2
    one = [model_config.vision_start_token_id] + [model_config.image_token_id] * (rows * cols) \
        + [model_config.vision_end_token_id]
    ids = torch.tensor(one * max(1, images))
    pixels = torch.randn((count, width), generator=torch.Generator().manual_seed(count))
    return {"input_ids": ids, "labels": torch.full_like(ids, -100), "pixel_values": pixels,
            "image_grid_thw": grid, "patches": count}


def worst_images(model_config, tokens: int, *, largest_image: int, max_patches: int | None
                 ) -> dict[str, torch.Tensor]:
    """The most vision patches a micro-batch of ``tokens`` tokens can hold: images of the largest
    size the processor makes (``largest_image`` patches), as many as the tokens hold (half of
    them at least left for text), at most ``max_patches`` patches in all where the run caps them."""
    merge2 = model_config.vision_config.spatial_merge_size ** 2
    per_image = min(largest_image, max_patches) if max_patches else largest_image
    per_image = max(merge2, min(per_image, max(1, tokens // 2 - 2) * merge2))
    image_tokens = per_image // merge2 + 2
    images = max(1, (tokens // 2) // image_tokens)
    if max_patches:
        images = max(1, min(images, max_patches // per_image))
    return image_sample(model_config, image_patches=per_image, images=images)


def special_token_ids(model_config) -> set[int]:
    """The ids a synthetic text must not use: every ``*_token_id`` / ``*_token_index`` of the
    model's config (image, video, vision start and end, ...), the nested text config's too."""
    ids: set[int] = set()
    for config in (model_config, getattr(model_config, "text_config", None)):
        for key, value in (vars(config).items() if config is not None else ()):
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) \
                    and not isinstance(value, bool):
                ids.add(value)
    plain: set[int] = set()  # the pad, bos and eos tokens (eos may be a list: Llama-3.1's) are text
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(model_config, name, None)
        plain.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    return ids - plain


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
              vocab_size: int, avoid: set[int], images: Callable[[int], dict[str, Any]] | None = None,
              log: Callable[[str], None] = print, max_trials: int = 16, group: int = 1) -> PreflightReport:
    """Measures the worst-case step at ``budget`` (an int), or searches for the largest that fits
    (``"auto"``, up to ``upper``), on every rank in lockstep (collective: one ``gather`` for the cap
    and one per trial).

    Args:
        step: runs one micro-batch of the given samples at the given budget through the run's
            engine (:meth:`OdbEngine.probe_step`); called inside the caller's :meth:`Backend.pristine`.
        gather: all ranks' int64 vectors (odb's gloo communicator).
        cap_mb: this rank's cap (:func:`memory_cap_mb`); the smallest over the ranks holds.
        images: a vision model's ``images(budget)``: the worst-case image sample at a budget
            (:func:`worst_images`).
        group: sequence parallelism's S: a budget is a rank's, and ``step`` gets rows of S times it
            (and that as its budget), which the S ranks of a group split.

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
        image = images(tokens) if images is not None else None
        patches[tokens] = int(image["patches"]) if image is not None else None
        peak = seconds = 0.0
        for batch in worst_case_batches(tokens * group, vocab_size=vocab_size, avoid=avoid, image=image):
            try:
                used, took = measure(lambda b=batch: step(b, tokens * group), device)
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
