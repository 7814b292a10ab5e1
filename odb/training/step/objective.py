"""What a step trains: the objective, the one seam between the engine's model calls and the loss
each micro-batch backs.

The engine (:class:`odb.training.step.engine.OdbEngine`) runs the model: collation, positions, the
blank image of a vision model, attention routed for sequence parallelism, the LM head in chunks; a
call returns the summed token losses of its samples (and, for a mixture-of-experts model, its
router loss). An :class:`Objective` turns those into the loss each micro-batch backs and into what
a step reports (:meth:`Objective.tally`), and scores an evaluation step (:meth:`Objective.evaluate`).
The engine calls nothing else of it, so a second objective (preference pairs, a reward model) is a
new class here, not branches in the engine. Whatever the objective, the plan fixes the step's
normalizer before its first backward, on every rank alike (I4).

:class:`NextToken`, the default, trains next-token cross entropy (supervised fine-tuning);
:class:`NextTokenTally` is its step. Per optimizer step every rank runs exactly the plan's GAS
micro-batches (dummies included), so every rank enters the same collectives (I1): ZeRO's or
FSDP2's parameter gathers in each forward, their gradient reductions. Its loss math (I4), with W
ranks, step s, micro-batches m on rank r and token losses l:

    wanted gradient   g = grad( sum_{r,m,t} l_{r,m,t} / N_s )     N_s = label tokens of the step,
                                                                  over all ranks (plan.num_label_tokens)
    Both backends average gradients over the W ranks (DeepSpeed's all-reduce / reduce-scatter,
    FSDP2's reduce-scatter) and neither divides by GAS (DeepSpeed: scale_wrt_gas=False); so each
    micro-batch backs
                      loss_{r,m} = sum_t l_{r,m,t} * W / N_s
    and  mean_r sum_m grad(loss_{r,m}) = g  exactly. A dummy micro-batch backs 0 * (its output):
    a real forward and backward (parameters gathered, gradients reduced) that adds nothing.

Mixture-of-experts models add their router load-balancing loss (:mod:`odb.training.model.moe`): each
real micro-batch backs, besides its token loss, ``coef * aux_{r,m} * T_{r,m} * W / T_s`` (its
real tokens T over the step's, ``plan.rank_tokens``), so the step trains the token-weighted mean
of its micro-batches' router losses, with the model's own coefficient.

Per source (a data mixture): each sample carries ``source``; a micro-batch whose samples come from
several sources splits its token losses at the samples' bounds into per-source sums
(:class:`odb.training.step.sources.SourceSplit`), from the same token losses whose sum it backs: no extra
forward, no second loss. A step reports them with each source's label tokens and samples
(:class:`StepResult`); the metrics add them up over ranks and steps (:mod:`odb.telemetry.sources`).

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from odb.batching.plan import MicroBatch, Shared, StepPlan
from odb.training.step.clock import ForwardClock
from odb.training.step.sources import SourceSums, sample_source

if TYPE_CHECKING:
    from odb.training.step.engine import OdbEngine

__all__ = ["NEXT_TOKEN", "NextToken", "NextTokenTally", "Objective", "StepResult", "StepTally"]


@dataclass
class StepResult:
    loss_sum: float  # this rank's summed token loss (real micro-batches)
    label_tokens: int  # this rank's label tokens
    lr: float
    aux_sum: float | None = None
    """MoE: this rank's ``sum_m aux_m * T_m`` (router loss times real tokens, coefficient not
    applied); summed over ranks and divided by the step's real tokens it is the step's ``aux_loss``.
    None for a model without a router loss."""
    aux_loss: float = 0.0
    """What this rank's micro-batches added to the trained objective: ``coef * aux_sum / T_s``
    (over all ranks these add up to ``coef * aux_loss``; 0 for a dense model)."""
    forward_seconds: tuple[float, ...] = ()
    """Each micro-batch's forward time (the loss included) on this rank (:class:`ForwardClock`)."""
    source_loss: tuple[float, ...] = ()
    """Per source id (a sample's ``source``): this rank's summed token loss of that source's samples
    (they add up to ``loss_sum``); as long as the largest source id of the step's samples + 1."""
    source_label_tokens: tuple[int, ...] = ()
    """Per source id: this rank's label tokens of that source (they add up to ``label_tokens``)."""
    source_samples: tuple[int, ...] = ()
    """Per source id: this rank's samples of that source."""
    rewards: tuple[float, float, int] | None = None
    """A preference objective (:mod:`odb.training.step.preference`): this rank's summed rewards of
    the chosen and of the rejected answers, and its pairs whose chosen reward is the higher; None
    for next-token loss. Its ``loss_sum`` is then the pairs' summed loss."""


class StepTally(Protocol):
    """One optimizer step of an objective: the loss each micro-batch backs, then what the step reports."""

    def loss(self, micro: MicroBatch, samples: Sequence[dict[str, Any]]) -> torch.Tensor:
        """The loss micro-batch ``micro`` backs; its forward runs here (a dummy's too)."""

    def result(self, lr: float) -> StepResult:
        """What the step reports, once every micro-batch's :meth:`loss` has run."""


class Objective(Protocol):
    """What odb trains (see the module docstring)."""

    name: str

    def tally(self, engine: OdbEngine, plan: StepPlan) -> StepTally:
        """A step's tally: :meth:`OdbEngine.train_step` backs each of its losses, then one optimizer step."""

    def evaluate(self, engine: OdbEngine, plan: StepPlan, samples: Sequence[Sequence[dict[str, Any]]], *,
                 truncate: bool = True, by_source: SourceSums | None = None) -> tuple[float, int]:
        """An evaluation step's ``(loss_sum, count)`` on this rank, forwards only (dummies too)."""

    def probe_loss(self, engine: OdbEngine, samples: Sequence[dict[str, Any]], shared: Shared | None
                   ) -> torch.Tensor:
        """0 x the loss of ``samples`` (each a sequence, whole) as a micro-batch of them trains it:
        the preflight's backward at a real size (:meth:`OdbEngine.probe_step`)."""


class NextTokenTally:
    """One optimizer step of :class:`NextToken`: its micro-batch losses, as :meth:`OdbEngine.train_step`
    backs them, and what the step reports: the loss math of the module docstring in one place, also for a host's own
    loop (:mod:`odb.integrations`), which runs the backward and the optimizer step itself."""

    def __init__(self, engine: OdbEngine, plan: StepPlan) -> None:
        self.engine, self.plan = engine, plan
        self.scale = engine.world_size / plan.num_label_tokens if plan.num_label_tokens else 0.0
        self.router = engine.router_loss is not None
        self.step_tokens = sum(map(sum, plan.rank_tokens))  # T_s: real tokens of the step over all ranks
        assert not self.router or self.step_tokens or all(m.is_dummy for m in plan.micro_batches), \
            "plan without rank_tokens"
        self.aux_scale = engine.world_size / self.step_tokens if self.step_tokens else 0.0
        self.loss_sum = torch.zeros((), device=engine.device)  # one host sync per step
        self.aux_sum = torch.zeros((), device=engine.device)
        self.label_tokens = 0
        self.by_source = SourceSums(engine.device)
        self.clock = ForwardClock(engine.device)

    def loss(self, micro: MicroBatch, samples: Sequence[dict[str, Any]]) -> torch.Tensor:
        """The loss micro-batch ``micro`` backs (its forward runs here): ``sum_t l_t * W / N_s`` (and
        a router loss's share), or 0 x a real forward for a dummy."""
        engine = self.engine
        self.clock.start()
        if micro.is_dummy:
            loss = engine.dummy_loss()
        else:
            summed, aux = engine.forward_loss(samples, micro.padded, router=self.router, by_source=self.by_source,
                                              shared=micro.shared)
            self.loss_sum += summed.detach()
            self.label_tokens += micro.label_tokens
            for sample, cost in zip(samples, micro.samples, strict=True):
                self.by_source.count(sample_source(sample), cost.label_tokens)
            loss = summed * self.scale
            if aux is not None:  # coef * aux_{r,m} * T_{r,m} * W / T_s (odb.training.model.moe)
                weighted = aux * (micro.shared.tokens if micro.shared is not None else micro.tokens)
                self.aux_sum += weighted.detach()
                loss = loss + engine.router_loss.coef * self.aux_scale * weighted
        self.clock.stop()
        return loss

    def result(self, lr: float) -> StepResult:
        """What the step reports, once every micro-batch's :meth:`loss` has run (a sequence-parallel
        group's ranks: the group's sums, one collective)."""
        seconds = self.clock.seconds()
        if self.engine.sp is not None:
            self.loss_sum, self.aux_sum, self.by_source.loss = self.engine.group_sums(
                self.loss_sum, self.aux_sum, self.by_source.loss)
        loss, tokens, samples = self.by_source.read()
        sources = {"source_loss": tuple(loss), "source_label_tokens": tuple(tokens), "source_samples": tuple(samples)}
        if not self.router:
            return StepResult(loss_sum=float(self.loss_sum), label_tokens=self.label_tokens, lr=lr,
                              forward_seconds=seconds, **sources)
        aux_sum = float(self.aux_sum)
        coef = self.engine.router_loss.coef
        return StepResult(loss_sum=float(self.loss_sum), label_tokens=self.label_tokens, lr=lr, aux_sum=aux_sum,
                          aux_loss=coef * aux_sum / self.step_tokens if self.step_tokens else 0.0,
                          forward_seconds=seconds, **sources)


class NextToken:
    """Next-token cross entropy over the label tokens, normalized by the step's label tokens on all
    ranks (``plan.num_label_tokens``), plus a mixture-of-experts model's own router loss."""

    name = "next_token"

    def tally(self, engine: OdbEngine, plan: StepPlan) -> NextTokenTally:
        return NextTokenTally(engine, plan)

    def evaluate(self, engine: OdbEngine, plan: StepPlan, samples: Sequence[Sequence[dict[str, Any]]], *,
                 truncate: bool = True, by_source: SourceSums | None = None) -> tuple[float, int]:
        """The summed next-token cross entropy of this rank's real micro-batches (micro-batch sums added
        in float64) and the label tokens it sums over, counted from the labels scored (cut to
        ``max_tokens`` as the collate does unless ``truncate`` is False; the first label of each sample
        never counts); a sequence-parallel group's ranks: the group's, one collective. ``by_source``
        gets the same figures per source."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)  # one host sync per step
        label_tokens = 0
        mine = by_source if by_source is None or engine.sp is None else SourceSums(engine.device)  # (this step's)
        for micro, micro_samples in zip(plan.micro_batches, samples, strict=True):
            if micro.is_dummy:
                engine.dummy_loss()
                continue
            loss_sum += engine.forward_loss(micro_samples, micro.padded, truncate=truncate, by_source=mine)[0].double()
            cap = engine.max_tokens if truncate else None
            for sample in micro_samples:
                tokens = int((torch.as_tensor(sample["labels"])[1:cap] != -100).sum())
                label_tokens += tokens
                if mine is not None:
                    mine.count(sample_source(sample), tokens)
        if engine.sp is not None:
            if mine is None:
                loss_sum, = engine.group_sums(loss_sum)
            else:
                loss_sum, mine.loss = engine.group_sums(loss_sum, mine.loss)
                by_source.add_sums(mine)
        return float(loss_sum), label_tokens


    def probe_loss(self, engine: OdbEngine, samples: Sequence[dict[str, Any]], shared: Shared | None
                   ) -> torch.Tensor:
        summed, aux = engine.forward_loss(samples, padded=False, router=engine.router_loss is not None,
                                          truncate=False, shared=shared)
        return (summed if aux is None else summed + aux) * 0.0


NEXT_TOKEN = NextToken()
"""The default objective: supervised fine-tuning."""
