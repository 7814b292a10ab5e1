"""Runs a training backend (DeepSpeed or FSDP2) over odb's step plans: the model calls of a step.

Per optimizer step every rank runs exactly the plan's GAS micro-batches (dummies included), so
every rank enters the same collectives (I1): ZeRO's or FSDP2's parameter gathers in each forward,
their gradient reductions. What each micro-batch backs is the objective's
(:mod:`odb.training.step.objective`: the loss math); the engine makes the model calls it asks for
(:meth:`OdbEngine.forward_loss`, :meth:`OdbEngine.dummy_loss`): collation (a packed row, or padded
rows for a model odb cannot pack), a vision model's positions and its blank image, the router
loss of a mixture-of-experts model.

The token losses come from :mod:`odb.training.step.loss` (by default): the LM head applied to chunks of
the final hidden states, never the row's full fp32 logits; ``loss_chunk_tokens=None`` keeps the
full-logits loss (:func:`token_loss_sum`), the oracle both are tested against.

Sequence parallelism (:mod:`odb.training.step.sequence_parallel`): the S ranks of a group run the same
plan, each on its slice of every packed row, its labels shifted before the cut; the formula above
holds as it is (W: all ranks; N_s counts each label token once per group; each rank's ``sum_t``
runs over its slice). What a step reports is summed over the group once per step. Per micro-batch
(over_cap 'sequence_parallel'): a micro-batch with ``shared`` is a long sample that a group of
ranks trains together while the others train their own; its owner sends it to the group
(:func:`odb.training.step.sequence_parallel.receive`) and each rank backs its slice's loss the same
way (its label tokens and samples count at the owner), attention routed through the group (:meth:`OdbEngine.route`).

Gradients are reduced across ranks only in the last backward of a step (``backend.backward(loss,
sync=m == last)``), then one ``backend.step()``; docs/design.md (loss math) records why (DeepSpeed
0.19.8: uneven micro-batch counts deadlock at every stage). What a backend must provide is
:class:`odb.training.backends.Backend`; the backends are the modules of :mod:`odb.training.backends`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from odb.batching.plan import MicroBatch, Shared, StepPlan
from odb.data.collate import collate_packed, collate_padded, to_device, token_sources
from odb.training import attention
from odb.training.attention.semantics import calls as attention_calls
from odb.training.backends.base import Backend
from odb.training.model.build import hf_model
from odb.training.model.moe import router_loss
from odb.training.model.mrope import mm_token_types, packed_position_ids, padded_position_ids, videos_as_images
from odb.training.step.loss import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    HeadLoss,
    final_logit_softcap,
    num_loss_chunks,
    token_loss_sum,
)
from odb.training.step.objective import NEXT_TOKEN, Objective, StepResult, StepTally
from odb.training.step.sequence_parallel import SequenceParallel, receive
from odb.training.step.sources import SourceSplit, SourceSums, sample_source

__all__ = ["BLANK_IMAGE_TOKENS", "OdbEngine"]

BLANK_IMAGE_TOKENS = 3  # vision start, one image pad (a 2x2-merged 4-patch image), vision end


class OdbEngine:
    """One training backend, fed step plans.

    Args:
        backend: the model, its optimizer and its collectives (:class:`Backend`).
        world_size: data-parallel ranks.
        max_tokens: per-sample truncation (the over-cap policy 'truncate').
        pad_token_id: for padded baselines and dummy rows.
        packed: pack rows (varlen); False for a model odb cannot pack correctly (padded fallback).
        loss_chunk_tokens: the loss from the LM head's input in chunks of at most this many scored
            tokens (``ceil(max_tokens / loss_chunk_tokens)`` chunks per micro-batch, on every rank
            alike); None: the model's full logits (:func:`token_loss_sum`).
        fused_loss: with chunks, use Liger's fused linear cross entropy where it can serve
            (:func:`odb.training.step.loss.liger_loss`: importable, CUDA, no ZeRO-3, plain head).
        sequence_parallel: this rank's sequence-parallel group (``max_tokens``: the group's budget,
            S x a rank's), or None.
        groups: over_cap 'sequence_parallel': this rank's group of each size that may train a long
            sample together (:func:`odb.training.step.sequence_parallel.setup_groups`), or None.
        rank: this rank (the owner of a shared micro-batch sends its sample to its group).
        objective: what the steps train (:mod:`odb.training.step.objective`; the default: next-token
            cross entropy).
    """

    def __init__(self, backend: Backend, *, world_size: int, max_tokens: int, pad_token_id: int, packed: bool = True,
                 loss_chunk_tokens: int | None = DEFAULT_LOSS_CHUNK_TOKENS, fused_loss: bool = True,
                 sequence_parallel: SequenceParallel | None = None,
                 groups: dict[int, SequenceParallel] | None = None, rank: int = 0,
                 objective: Objective = NEXT_TOKEN) -> None:
        self.backend = backend
        self.objective = objective
        self.world_size = world_size
        self.rank = rank
        self.groups = groups or {}
        if self.groups and (sequence_parallel is not None or not packed):
            raise ValueError("over_cap 'sequence_parallel' splits a long sample's packed row; it needs packed rows "
                             "and no --sequence_parallel_size")
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.sp = sequence_parallel
        if self.sp is not None and not packed:
            raise ValueError("sequence parallelism splits packed rows; this model trains padded rows")
        self.device = backend.device
        self.model = hf_model(backend.module)
        self.vision = getattr(getattr(self.model, "model", None), "visual", None)
        self._blank: dict[str, torch.Tensor] | None = None
        self.router_loss = router_loss(self.model)  # None: a model without a router loss
        self._attention_seen = False  # the first model call went through odb's attention (_loss)
        self.head_loss = None if loss_chunk_tokens is None else HeadLoss(
            self.model.get_output_embeddings(), softcap=final_logit_softcap(self.model.config),
            num_chunks=num_loss_chunks(-(-max_tokens // self.sp.size) if self.sp else max_tokens, loss_chunk_tokens),
            fused=fused_loss)

    def forward_loss(self, samples: Sequence[dict[str, Any]], padded: bool, *, router: bool = False,
                     truncate: bool = True, by_source: SourceSums | None = None, shared: Shared | None = None,
                     per_sample: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The summed token loss of ``samples`` in one model call, and with ``router`` (a model with
        a router loss) its router loss ``aux`` over the samples' own tokens (else None); each sample
        cut to ``max_tokens`` unless ``truncate`` is False. ``by_source`` gets the loss split by the
        samples' sources (the call's whole sum where they share one). ``shared``: this rank's slice
        of a long sample that its group trains together (its owner's ``samples`` hold it, sent to the
        others here), whole, with the attention routed through the group (:meth:`route`).
        ``per_sample``: each sample's own summed loss ``[n]``, with its gradients, instead of the sum."""
        if shared is not None:
            samples = receive(self.groups[shared.degree], shared.owner, shared.tokens, samples, rank=self.rank,
                              device=self.device)
            truncate = False
        if per_sample:  # each sample a source of its own (no sequence parallelism)
            samples = [{**sample, "source": k} for k, sample in enumerate(samples)]
        is_dummy, blank = not samples, self._needs_blank(samples)
        present = sorted({sample_source(s) for s in samples})
        split_rows = per_sample or (by_source is not None and len(present) > 1)  # split the token losses
        samples = [*samples, self._blank_image()] if blank else samples
        cap = self.max_tokens if truncate else None
        if padded or not self.packed:
            batch = collate_padded(samples, pad_token_id=self.pad_token_id, max_tokens=cap, sources=split_rows)
        else:
            batch = collate_packed(samples, max_tokens=cap, sources=split_rows)
        if shared is not None or self.sp is not None:
            sp = self.sp if shared is None else self.groups[shared.degree]
            summed, aux, split = self._sharded_call(batch, present if split_rows else None, router=router, sp=sp)
        else:
            summed, aux, split = self._row_call(batch, present if split_rows else None, router=router,
                                                is_dummy=is_dummy, blank=blank, graph=per_sample)
        if per_sample:
            return split.graded, aux
        if split is not None:
            by_source.add_split(split)
        elif by_source is not None and present:
            by_source.add_total(present[0], summed)
        return summed, aux

    def _row_call(self, batch: dict[str, Any], present: list[int] | None, *, router: bool, is_dummy: bool,
                  blank: bool, graph: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, SourceSplit | None]:
        """:meth:`forward_loss`'s model call on a collated ``batch`` (``present``: split the token
        losses over these sources, ``graph``: with their gradients; the blank image, labels all -100,
        counts as source 0 and adds nothing): the summed loss, the router loss (or None) and the split (or None)."""
        split = None
        if present is not None:
            split = SourceSplit(token_sources(batch).to(self.device), present, graph=graph)
            del batch["sources"]  # not the model's
        batch = to_device(batch, self.device)
        labels = batch.pop("labels")
        if self.vision is not None:
            self._vision_inputs(batch)
        # a dummy (the blank image alone) has no real token: its router loss over every token, weighed 0
        real = None if is_dummy else _real_tokens(batch, blank=blank)
        summed, aux = self._call(batch, labels, router=router, real_tokens=real, split=split)
        return summed, aux, split

    def _sharded_call(self, batch: dict[str, Any], present: list[int] | None, *, router: bool, sp: SequenceParallel
                      ) -> tuple[torch.Tensor, torch.Tensor | None, SourceSplit | None]:
        """:meth:`_row_call` under sequence parallelism: the model call on this rank's slice of the
        row (:meth:`SequenceParallel.shard`), its labels shifted before the cut. The router loss is
        the slice's, times the slice's share of the row's tokens: the step weighs a micro-batch's
        router loss by the row's tokens, so the group's ranks together weigh each slice's by its own. A
        slice of padding alone (a short row cut into S) has no token of its own to route: its router
        loss runs over every token, weighed 0 (over none it would be 0 / 0, and NaN x 0 is NaN)."""
        sources = token_sources(batch) if present is not None else None
        labels = batch.pop("labels")
        inputs, labels, sources, real = sp.shard(batch, labels, pad_token_id=self.pad_token_id, sources=sources)
        share = int(real.sum()) / batch["input_ids"].shape[1]
        inputs = to_device(inputs, self.device)
        labels, real = labels.to(self.device), real.to(self.device)
        split = None if sources is None else SourceSplit(sources.to(self.device), present, shifted=True)
        summed, aux = self._call(inputs, labels, router=router, real_tokens=real if share else None, split=split,
                                 shifted=True)
        return summed, None if aux is None else aux * share, split

    @contextlib.contextmanager
    def route(self, micro: MicroBatch) -> Iterator[None]:
        """While a shared micro-batch runs (its forward and its backward, which may run the
        forward again: activation checkpointing), attention goes through its group's Ulysses
        all-to-all; straight again after it."""
        if micro.shared is None:
            yield
            return
        attention.route_through(self.groups[micro.shared.degree].around)
        try:
            yield
        finally:
            attention.route_through(None)

    def group_sums(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each of ``values`` summed over this rank's sequence-parallel group (one collective; every
        rank of the group calls it, in step): a step's or an evaluation's figures."""
        flat = torch.cat([v.reshape(-1).double() for v in values])
        summed = self.sp.group_sum(flat)
        out, at = [], 0
        for value in values:
            out.append(summed[at:at + value.numel()].reshape(value.shape).to(value.dtype))
            at += value.numel()
        return tuple(out)

    def _call(self, batch: dict[str, Any], labels: torch.Tensor, *, router: bool,
              real_tokens: torch.Tensor | None = None, split: SourceSplit | None = None, shifted: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model call: the summed token loss (``split``: also by source; ``shifted``: labels
        already each position's target) and, with ``router``, the router loss over ``real_tokens``
        (None: every token)."""
        if not router:
            return self._loss(batch, labels, split=split, shifted=shifted), None
        output: dict[str, Any] = {}

        def forward():
            output["out"] = self.backend(**batch, use_cache=False, **self.router_loss.call_kwargs)
            return output["out"]

        summed = self._loss(batch, labels, forward, split=split, shifted=shifted)
        return summed, self.router_loss(output["out"], real_tokens, batch.get("attention_mask"))

    def _loss(self, batch: dict[str, Any], labels: torch.Tensor, forward=None, *,
              split: SourceSplit | None = None, shifted: bool = False) -> torch.Tensor:
        """The summed token loss of one model call (through the backend either way; ``forward``:
        the call, when it is not the plain one), the first one's attention checked."""
        forward = forward or (lambda: self.backend(**batch, use_cache=False))
        with self._attention_checked():
            if self.head_loss is None:
                return token_loss_sum(forward().logits, labels, split, shifted=shifted)
            return self.head_loss.forward_loss(forward, labels, split, shifted=shifted)

    def call(self, batch: dict[str, Any]) -> Any:
        """One plain model call on a collated ``batch`` on the device (no loss: a reward model's
        scores, :mod:`odb.training.step.reward`), its attention checked as :meth:`_loss` checks it."""
        with self._attention_checked():
            return self.backend(**batch, use_cache=False)

    @contextlib.contextmanager
    def _attention_checked(self) -> Iterator[None]:
        """Around the first model call: checks that the model's attention went through odb's (a
        model that computes attention its own way would attend across the packed row;
        :func:`odb.training.model.capability.packing_refusal` refuses those at start)."""
        before = None if self._attention_seen else sum(attention_calls.values())
        yield
        if before is None:
            return
        if sum(attention_calls.values()) == before:
            chosen = getattr(self.model.config, "_attn_implementation", None)
            if chosen != attention.ATTN_IMPLEMENTATION:  # (a host's own model, loaded with its default)
                raise ValueError(f"{type(self.model).__name__} runs attn_implementation {chosen!r}, which would "
                                 "let packed samples attend to each other: switch it to odb's, "
                                 "model.set_attn_implementation(odb.training.attention.register())")
            raise ValueError(f"{type(self.model).__name__} never called odb's attention in its forward: it "
                             "computes attention its own way, so packed samples would attend to each other; "
                             "odb cannot train it (check it with odb check-model)")
        self._attention_seen = True

    def _vision_inputs(self, batch: dict[str, Any]) -> None:
        """A vision model's rotary positions, in ``batch``: each packed sample's own M-RoPE (text in row
        0), or the model's own over padded rows, made here; then its videos handed over as images, one
        vision-tower call per micro-batch (:mod:`odb.training.model.mrope`). A model whose positions odb does
        not make derives them itself (from ``mm_token_type_ids``), its videos as videos."""
        if "cu_seq_lens_q" in batch:
            batch["position_ids"] = packed_position_ids(self.model, batch["input_ids"], batch["cu_seq_lens_q"],
                                                        batch.get("image_grid_thw"), batch.get("video_grid_thw"),
                                                        batch.get("second_per_grid_ts"))
        elif hasattr(self.model.model, "get_rope_index"):
            batch["position_ids"] = padded_position_ids(self.model, batch)
        else:
            del batch["position_ids"]
            batch["mm_token_type_ids"] = mm_token_types(batch["input_ids"], self.model.config)
            return
        videos_as_images(batch, self.model.config)

    def _needs_blank(self, samples: Sequence[dict[str, Any]]) -> bool:
        """A micro-batch without images or videos gets one tiny blank image as a sample of its own, the last
        (its labels all -100, its attention its own): every rank then runs the model's modules in the
        same order in every micro-batch (embeddings, vision tower, language model), which ZeRO-3's and
        FSDP2's per-module parameter gathers need, and every rank has vision gradients to reduce."""
        return self.vision is not None and not any(s.get("pixel_values") is not None or
                                                   s.get("pixel_values_videos") is not None for s in samples)

    def _blank_image(self) -> dict[str, torch.Tensor]:
        if self._blank is None:
            spec, config = self.model.config.vision_config, self.model.config
            merge = spec.spatial_merge_size
            width = spec.in_channels * spec.temporal_patch_size * spec.patch_size ** 2
            ids = torch.tensor([config.vision_start_token_id, config.image_token_id, config.vision_end_token_id])
            self._blank = {"input_ids": ids, "labels": torch.full_like(ids, -100),
                           "pixel_values": torch.zeros((merge * merge, width)),
                           "image_grid_thw": torch.tensor([[1, merge, merge]])}
        return self._blank

    def dummy_loss(self, router: bool | None = None) -> torch.Tensor:
        """0 x the outputs of a real (tiny) call, with the graph of a real micro-batch's loss: the
        router loss too (MoE; ``router`` False where the real ones have none: a preference objective's),
        so that every rank's backward runs the same way. ZeRO-3 gathers a
        layer's parameters in its backward, and a checkpointed layer's recomputation runs when the
        backward first needs it: a rank whose loss left out the router logits would recompute and
        gather its layers in another order than the others, and hang (measured: Qwen3-MoE at ZeRO-3
        with --gradient_checkpointing, either way round)."""
        router = self.router_loss is not None if router is None else router
        if self.vision is not None:  # a real pass through every module, as the others run
            summed, aux = self.forward_loss([], padded=False, router=router)
        else:
            ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
            batch = {"input_ids": ids, "position_ids": torch.zeros_like(ids)}
            if self.head_loss is None and not router:
                return self.backend(**batch, use_cache=False).logits.float().sum() * 0.0
            # (chunked loss: the head runs as often as in a real one)
            summed, aux = self._call(batch, torch.full_like(ids, -100), router=router)
        return (summed if aux is None else summed + aux) * 0.0

    def save(self, folder: Path, tag: str) -> None:
        """The backend's checkpoint of the model and optimizer in ``folder / tag`` (collective)."""
        self.backend.save(folder, tag)

    def load(self, folder: Path, tag: str) -> None:
        """Loads :meth:`save`'s checkpoint (collective); raises ``FileNotFoundError`` if none."""
        self.backend.load(folder, tag)

    def train_step(self, plan: StepPlan, samples: Sequence[Sequence[dict[str, Any]]], lr: float) -> StepResult:
        """Runs the plan's micro-batches (``samples[m]``: the processed samples of micro-batch m,
        empty for a dummy) and one optimizer step at learning rate ``lr``."""
        self.backend.set_lr(lr)
        tally = self.tally(plan)
        last = len(plan.micro_batches) - 1
        for m, (micro, micro_samples) in enumerate(zip(plan.micro_batches, samples, strict=True)):
            with self.route(micro):
                self.backend.backward(tally.loss(micro, micro_samples), sync=m == last)
        self.backend.step()
        return tally.result(lr)

    def tally(self, plan: StepPlan) -> StepTally:
        """The objective's tally of one step (:meth:`train_step`'s; a host's own loop backs its losses
        itself, :mod:`odb.integrations`)."""
        return self.objective.tally(self, plan)

    def probe_step(self, samples: Sequence[dict[str, Any]], *,
                   earlier: Sequence[dict[str, Any]] | None = None, shared: Shared | None = None) -> None:
        """One micro-batch of ``samples`` through the model (whole: no truncation), its backward and
        an optimizer step, at their real size and changing no weight: the loss (and a router loss)
        is backed with weight 0, so every gradient is 0, and the step runs at learning rate 0 (AdamW
        and SGD then leave each weight as it is). ``earlier``: a micro-batch run first without
        reducing its gradients, as the earlier micro-batches of a step with GAS > 1 are.
        ``shared``: the micro-batch is this rank's slice of a long sample its group trains
        together, as :meth:`train_step` runs one (``samples``: the sample at its owner, empty
        elsewhere). The optimizer's state it makes is the caller's to reset
        (:meth:`Backend.pristine`). The preflight's step (:mod:`odb.training.run.preflight`)."""
        self.backend.set_lr(0.0)
        for micro, last in ((earlier, False), (samples, True)):
            if micro is None:
                continue
            with self.route(MicroBatch((), shared=shared if last else None)):
                self.backend.backward(self.objective.probe_loss(self, micro, shared if last else None), sync=last)
        self.backend.step()

    @torch.no_grad()
    def eval_step(self, plan: StepPlan, samples: Sequence[Sequence[dict[str, Any]]], *,
                  objective: Objective | None = None, **options: Any) -> tuple[float, int]:
        """Forwards only, no gradients: the plan's micro-batches as :meth:`train_step` runs them
        (dummies too, so every rank enters ZeRO-3's or FSDP2's parameter gathers alike), no backward, no step.
        ``objective``: scores them instead of the run's; ``options``: the objective's (``truncate``
        False: samples scored whole, evaluation's over-cap ones; ``by_source``: per source; ``rewards``).

        Returns:
            the objective's ``(loss_sum, count)`` of this rank's real micro-batches
            (:meth:`odb.training.step.objective.Objective.evaluate`; next-token: the summed cross
            entropy and the label tokens it sums over).
        """
        return (objective or self.objective).evaluate(self, plan, samples, **options)


def _real_tokens(batch: dict[str, Any], *, blank: bool) -> torch.Tensor:
    """``[B, T]`` 1 where a token is a sample's own: not padding (the padded layout's mask), not the
    blank image (the last sample: the row's last segment, or the last padded row)."""
    mask = batch.get("attention_mask")
    real = torch.ones_like(batch["input_ids"]) if mask is None else mask.clone()
    if blank:
        if "cu_seq_lens_q" in batch:
            real[0, int(batch["cu_seq_lens_q"][-2]):] = 0
        else:
            real[-1] = 0
    return real

