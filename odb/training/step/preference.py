"""Preference objectives over packed pairs: DPO (sigmoid), IPO and hinge against a reference, and
the reference-free SimPO and ORPO.

A pair sample (:mod:`odb.data.preference`) is one packing unit: its chosen and its rejected
sequence (each the prompt and one answer, the answer's tokens its labels) sit in the same
micro-batch on the same rank, each a varlen segment of its own, and the batcher counts both
(``tokens``, ``label_tokens``). One model call per micro-batch gives each sequence's summed log
probability of its labels, ``pi = -sum_t CE_t``, with its gradient (:meth:`OdbEngine.forward_loss`
with ``per_sample``: the token losses split at the segments' bounds, the same split as a mixture's
per-source sums). With ``rho`` the reference's log-probability
(:data:`odb.training.config.objective.REFERENCES`; a host's separate reference model:
:data:`~odb.training.config.objective.HOST_REFERENCES`), ``n`` the
answer's scored label tokens, ``a = pi / n``, ``beta`` and ``gamma`` the objective's constants, the
loss of pair p (chosen c, rejected r)::

    dpo    -log sigmoid(beta * ((pi_c - rho_c) - (pi_r - rho_r)))            TRL DPO loss_type 'sigmoid'
    ipo    ((pi_c - rho_c) / n_c - (pi_r - rho_r) / n_r - 1 / (2 beta))^2    TRL DPO 'ipo' (per token)
    hinge  relu(1 - beta * ((pi_c - rho_c) - (pi_r - rho_r)))                TRL DPO 'hinge'
    simpo  -log sigmoid(beta * (a_c - a_r) - gamma)                          TRL CPO 'simpo'
    orpo   -a_c - beta * log sigmoid((a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)))   TRL ORPO

ORPO's first term is each pair's mean token NLL of its chosen answer; TRL's ORPOTrainer takes the
mean over the batch's chosen tokens instead, which is not a mean over pairs and so would not
normalize exactly across ranks; the two agree when every chosen answer has as many tokens.

The loss math (I4, as for next-token loss): the step trains the mean over its pairs on all ranks,
``P_s = plan.num_samples`` (a pair is one sample; every rank knows it before the first backward).
Both backends average gradients over the W ranks, so each micro-batch backs
``sum_p loss_p * W / P_s``, a dummy ``0 x`` a real forward; the gradient is then one process's over
the whole step. What a step reports: ``loss_sum`` (the pairs' summed loss; the step's loss is it
over ``P_s``), and :attr:`StepResult.rewards`: the summed rewards ``beta * (pi - rho)`` (simpo,
orpo: ``beta * a``) of the chosen and the rejected answers and the pairs whose chosen reward is the
higher (``rewards/accuracies``). A mixture-of-experts model's router loss is not added (as TRL's
CPO and ORPO trainers by default, ``output_router_logits`` off; TRL 1.16's DPOTrainer adds it by
default, which ``with_odb(DPOTrainer)`` refuses unless ``router_aux_loss_coef=0.0``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from odb.batching.cost import count_label_tokens
from odb.batching.plan import MicroBatch, Shared, StepPlan
from odb.data.preference import pair_sequences
from odb.training.config.objective import HOST_REFERENCES, LOSSES, REFERENCE_FREE, REFERENCES
from odb.training.step.clock import ForwardClock
from odb.training.step.objective import NEXT_TOKEN, StepResult
from odb.training.step.sources import SourceSums, sample_source

if TYPE_CHECKING:
    from odb.training.step.engine import OdbEngine

__all__ = ["Preference", "PreferenceTally", "pair_losses", "reference_free"]

def reference_free(loss: str) -> bool:
    return loss in REFERENCE_FREE


def pair_losses(loss: str, pi: torch.Tensor, rho: torch.Tensor | None, n: torch.Tensor, *, beta: float,
                gamma: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss ``[P]`` and its rewards ``[P, 2]`` (chosen, rejected; detached), from the
    policy's log-probabilities ``pi [P, 2]``, the reference's ``rho [P, 2]`` (None: reference free)
    and the answers' label tokens ``n [P, 2]`` (the module docstring's formulas)."""
    if reference_free(loss):
        mean = pi / n
        rewards = beta * mean.detach()
        if loss == "simpo":
            return -F.logsigmoid(beta * (mean[:, 0] - mean[:, 1]) - gamma), rewards
        log_odds = (mean[:, 0] - mean[:, 1]) - (_log1mexp(mean[:, 0]) - _log1mexp(mean[:, 1]))
        return -mean[:, 0] - beta * F.logsigmoid(log_odds), rewards
    assert rho is not None, f"{loss} needs reference log-probabilities"
    ratio = pi - rho
    rewards = beta * ratio.detach()
    if loss == "ipo":
        per_token = ratio / n
        return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2, rewards
    margin = beta * (ratio[:, 0] - ratio[:, 1])
    if loss == "hinge":
        return torch.relu(1 - margin), rewards
    return -F.logsigmoid(margin), rewards


_CERTAIN = 1e-6
"""ORPO's mean log-probabilities are taken as at most ``-_CERTAIN``: an answer every label token of
which the model is sure of in fp32 (each token's cross entropy exactly 0 once its logit leads by
about 17) has ``a = 0``, where ``log(1 - e^a)`` is ``-inf`` and its gradient NaN, which would reach
every weight. Above it the odds-ratio term's gradient in ``a`` is left out (the NLL term's is not);
its value moves by about ``beta * 1e-6``."""


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends, with finite gradients up to 0 (``x``
    taken as at most ``-_CERTAIN``). Each branch of the ``where`` gets only the inputs it serves:
    the branch not taken still runs its backward, and ``log1p(-exp(x))`` at ``exp(x) == 1`` (fp32,
    ``x > -6e-8``) would give ``0 x inf``, NaN."""
    x = x.clamp(max=-_CERTAIN)
    near = x > -0.6931
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, -1.0))),
                       torch.log1p(-torch.exp(torch.where(near, -1.0, x))))


@dataclass(frozen=True)
class Preference:
    """A preference objective (the module docstring). ``reference``: :data:`REFERENCES`, or
    :data:`HOST_REFERENCES`' ``model`` with :attr:`reference_model`."""

    loss: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5
    reference: str = "adapter"
    reference_model: OdbEngine | None = field(default=None, compare=False, repr=False)
    """Reference ``model``: the engine over the separate reference model (a host's), whose forward
    gives ``rho``; None for every other reference."""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"the preference loss must be one of {LOSSES}, got {self.loss!r}")
        if self.reference not in REFERENCES + HOST_REFERENCES:
            raise ValueError(f"the reference must be one of {REFERENCES}, got {self.reference!r}")
        if (self.reference == "model") != (self.reference_model is not None):
            raise ValueError("reference 'model' is a host's separate reference model (with_odb(DPOTrainer)'s "
                             "ref_model), run through an engine of its own: pass reference_model with it, and with "
                             "it only; odb's own loop has none (--reference adapter, data or precompute)")
        free = reference_free(self.loss)
        if free != (self.reference == "none"):
            raise ValueError(f"{self.loss} is {'reference free' if free else 'against a reference'}: reference "
                             f"{'none' if free else 'adapter, data or precompute'}, not {self.reference!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")

    @property
    def name(self) -> str:
        return self.loss

    def tally(self, engine: OdbEngine, plan: StepPlan) -> PreferenceTally:
        return PreferenceTally(self, engine, plan)

    def logps(self, engine: OdbEngine, micro: MicroBatch, samples: Sequence[dict[str, Any]], *, truncate: bool = True
              ) -> torch.Tensor:
        """The model's summed log-probabilities ``[P, 2]`` of each pair's chosen and rejected answer
        labels, each sequence cut to ``max_tokens`` unless ``truncate`` is False: one model call, with
        gradients where they are on. The policy's ``pi``, the adapter reference's ``rho``, and what
        reference 'precompute' keeps of the initial weights (:mod:`odb.training.run.reference`)."""
        return _logps(engine, micro, [seq for sample in samples for seq in pair_sequences(sample)], truncate)

    def pairs(self, engine: OdbEngine, micro: MicroBatch, samples: Sequence[dict[str, Any]], *, truncate: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' losses ``[P]`` and rewards ``[P, 2]`` of one real micro-batch (its model
        calls: the reference's first, then the policy's)."""
        seqs = [seq for sample in samples for seq in pair_sequences(sample)]
        cap = engine.max_tokens if truncate else None
        n = torch.tensor([count_label_tokens(seq["labels"][:cap].tolist()) for seq in seqs],
                         dtype=torch.float32, device=engine.device).view(-1, 2)
        rho = None
        if self.reference in ("adapter", "model"):
            reference, switched = self._reference(engine)
            with torch.no_grad(), switched:
                rho = _logps(reference, micro, seqs, truncate)
        elif self.reference in ("data", "precompute"):  # (precompute: the run's table put them there)
            missing = [sample["index"] for sample in samples if "ref_logps" not in sample]
            if missing:
                raise ValueError(_missing_reference(self.reference, missing[0]))
            rho = torch.tensor([sample["ref_logps"] for sample in samples], dtype=torch.float32, device=engine.device)
        pi = _logps(engine, micro, seqs, truncate)
        return pair_losses(self.loss, pi, rho, n, beta=self.beta, gamma=self.gamma)

    def dummy(self, engine: OdbEngine) -> torch.Tensor:
        """A dummy micro-batch's loss, after the same model calls as a real one (the reference's
        without gradients), so that every rank gathers ZeRO-3's or FSDP2's parameters alike: no
        router logits either (a mixture-of-experts model's), as a real one's calls have none."""
        if self.reference in ("adapter", "model"):
            reference, switched = self._reference(engine)
            with torch.no_grad(), switched:
                reference.dummy_loss(router=False)
        return engine.dummy_loss(router=False)

    def probe_loss(self, engine: OdbEngine, samples: Sequence[dict[str, Any]], shared: Shared | None
                   ) -> torch.Tensor:
        """The preflight's step: the reference's forward over ``samples`` without gradients (as a
        pair micro-batch of as many tokens runs it first: its time counts), then next-token loss
        over them, the policy's model call of a pair micro-batch of as many tokens."""
        if self.reference == "adapter" or self.reference_model is not None:
            reference, switched = self._reference(engine)
            with torch.no_grad(), switched:
                reference.forward_loss(samples, padded=False, truncate=False)
        return NEXT_TOKEN.probe_loss(engine, samples, shared)

    def _reference(self, engine: OdbEngine) -> tuple[OdbEngine, contextlib.AbstractContextManager[None]]:
        """Where a reference forward runs: the policy's engine with its adapter off (``adapter``),
        or the separate reference model's own engine (``model``: its own LM head too)."""
        if self.reference == "model":
            assert self.reference_model is not None
            return self.reference_model, contextlib.nullcontext()
        return engine, _adapter_disabled(engine)

    def evaluate(self, engine: OdbEngine, plan: StepPlan, samples: Sequence[Sequence[dict[str, Any]]], *,
                 truncate: bool = True, by_source: SourceSums | None = None, rewards: list[float] | None = None
                 ) -> tuple[float, int]:
        """An evaluation step: the summed pair loss of this rank's real micro-batches and its pairs;
        ``by_source`` gets the same per source (its label tokens count pairs, as the evaluation's
        total does); ``rewards`` (three numbers) gets the summed chosen and rejected rewards and the
        pairs ranked right added."""
        total, count = 0.0, 0
        for micro, micro_samples in zip(plan.micro_batches, samples, strict=True):
            if micro.is_dummy:
                self.dummy(engine)
                continue
            losses, scores = self.pairs(engine, micro, micro_samples, truncate=truncate)
            total += float(losses.double().sum())
            count += len(micro_samples)
            if by_source is not None:
                _by_source(by_source, micro_samples, losses, [1] * len(micro_samples))
            if rewards is not None:
                for i, value in enumerate(_reward_terms(scores).tolist()):
                    rewards[i] += value
        return total, count


class PreferenceTally:
    """One optimizer step of a :class:`Preference` objective: each micro-batch backs
    ``sum_p loss_p * W / P_s`` (the module docstring). Per source (a mixture) it reports the pairs'
    summed losses, their label tokens and the pairs (:attr:`StepResult.source_loss`, ...)."""

    def __init__(self, objective: Preference, engine: OdbEngine, plan: StepPlan) -> None:
        self.objective, self.engine, self.plan = objective, engine, plan
        self.scale = engine.world_size / plan.num_samples if plan.num_samples else 0.0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
        self.rewards = torch.zeros(3, dtype=torch.float64, device=engine.device)  # chosen, rejected, ranked right
        self.label_tokens = 0
        self.by_source = SourceSums(engine.device)  # per source: pair losses, label tokens, pairs
        self.clock = ForwardClock(engine.device)

    def loss(self, micro: MicroBatch, samples: Sequence[dict[str, Any]]) -> torch.Tensor:
        self.clock.start()
        if micro.is_dummy:
            loss = self.objective.dummy(self.engine)
        else:
            losses, rewards = self.objective.pairs(self.engine, micro, samples)
            self.loss_sum += losses.detach().double().sum()
            self.rewards += _reward_terms(rewards)
            self.label_tokens += micro.label_tokens
            _by_source(self.by_source, samples, losses, [cost.label_tokens for cost in micro.samples])
            loss = losses.sum() * self.scale
        self.clock.stop()
        return loss

    def result(self, lr: float) -> StepResult:
        chosen, rejected, right = self.rewards.tolist()
        loss, tokens, pairs = self.by_source.read()
        return StepResult(loss_sum=float(self.loss_sum), label_tokens=self.label_tokens, lr=lr,
                          forward_seconds=self.clock.seconds(), rewards=(chosen, rejected, int(right)),
                          source_loss=tuple(loss), source_label_tokens=tuple(tokens), source_samples=tuple(pairs))


def _logps(engine: OdbEngine, micro: MicroBatch, seqs: list[dict[str, Any]], truncate: bool) -> torch.Tensor:
    """:meth:`Preference.logps` of the pairs' sequences (chosen, rejected, chosen, ...)."""
    return -engine.forward_loss(seqs, micro.padded, truncate=truncate, per_sample=True)[0].view(-1, 2)


def _by_source(sums: SourceSums, samples: Sequence[dict[str, Any]], losses: torch.Tensor, counts: Sequence[int]
               ) -> None:
    """Each pair's loss into its source's sum, its pair and ``counts`` (its label tokens, or 1) into its
    source's counts (a mixture's figures: :mod:`odb.telemetry.sources`): one sum per source present."""
    sources = [sample_source(sample) for sample in samples]
    for source, count in zip(sources, counts, strict=True):
        sums.count(source, count)
    losses = losses.detach().double()  # (each pair added in fp64)
    for source in sorted(set(sources)):
        mine = [i for i, s in enumerate(sources) if s == source]
        sums.add_total(source, losses.sum() if len(mine) == len(sources) else losses[mine].sum())


def _reward_terms(rewards: torch.Tensor) -> torch.Tensor:
    """``[P, 2]`` rewards -> ``[3]`` fp64: the chosen ones' sum, the rejected ones' sum, the pairs
    ranked right (no host sync)."""
    return torch.cat([rewards.double().sum(0), (rewards[:, 0] > rewards[:, 1]).double().sum()[None]])


def _missing_reference(reference: str, index: int) -> str:
    if reference == "data":
        return (f"reference 'data': record {index} has no ref_chosen_logps / ref_rejected_logps; give every record "
                "both (the reference model's summed log-probabilities of each answer), use --reference precompute "
                "(the initial weights', computed before the first step), or train LoRA with reference 'adapter'")
    return (f"reference 'precompute': pair {index} has no entry in the run's reference table (reference_logps.npy "
            "in --output_dir: its pass skipped or dropped the pair, and training did not); remove the table's "
            "files to make it again")


@contextlib.contextmanager
def _adapter_disabled(engine: OdbEngine) -> Iterator[None]:
    """The model with its LoRA adapter off: the base model, the reference of a LoRA run.

    PEFT's ``disable_adapter`` turns the adapter weights' ``requires_grad`` off, and on again, on the
    parameters its modules hold at each moment. FSDP2 swaps a unit's parameters for gathered copies
    in its forward and keeps them until the backward where the unit does not reshard after its
    forward (the root, which holds the LM head; every unit under ``reshard_after_forward`` false):
    PEFT would turn the copies on again and leave the parameters themselves frozen (so dropped from
    checkpoints as frozen). So every parameter's flag, as it was, is set back here."""
    module = engine.backend.module
    disable = getattr(module, "disable_adapter", None)
    if disable is None:
        raise ValueError("reference 'adapter' needs a LoRA run (--lora ...): a full fine-tune changes the weights the "
                         "reference must keep; use reference 'precompute' (the initial weights' log-probs, computed "
                         "before the first step) or 'data' (the records' ref_chosen_logps / ref_rejected_logps), "
                         "or train a reference-free loss (simpo, orpo)")
    flags = [(param, param.requires_grad) for param in module.parameters()]
    try:
        with disable():
            yield
    finally:
        for param, flag in flags:
            if param.requires_grad != flag:
                param.requires_grad_(flag)
