"""What a run trains (``--objective``): next-token cross entropy (SFT), or a preference loss over
chosen/rejected pairs (:mod:`odb.training.step.preference`, which holds the formulas). Light (no
torch): checked before the heavy imports."""

from __future__ import annotations

from dataclasses import dataclass, field

from odb.settings import check, check_number, flag

__all__ = ["HOST_REFERENCES", "LOSSES", "OBJECTIVES", "REFERENCES", "ObjectiveSettings", "padded_refusal",
           "run_scores"]

LOSSES = ("dpo", "ipo", "hinge", "simpo", "orpo", "reward")
"""The preference losses (``reward``: a Bradley-Terry reward model's, on a score head)."""
REFERENCE_FREE = ("simpo", "orpo", "reward")
OBJECTIVES = ("next_token", *LOSSES)
REFERENCES = ("adapter", "data", "precompute", "none")
"""Where the reference log-probabilities come from: ``adapter``: the model with its LoRA adapter
disabled (the base model; one forward without gradients per micro-batch, dummies too); ``data``:
each record's ``ref_chosen_logps`` / ``ref_rejected_logps`` (the names TRL's
``precompute_ref_log_probs`` writes); ``precompute``: the initial weights' own, from one
forward-only pass over the training data before the first step, kept in ``--output_dir``
(:mod:`odb.training.run.reference`), then read as ``data``'s; ``none``: a reference-free loss
(simpo, orpo, reward)."""
HOST_REFERENCES = ("model",)
"""References of a host's loop only (:mod:`odb.integrations.hf`), never a ``--reference`` choice:
``model``: a separate reference model (TRL's ``ref_model``), its forward without gradients per
micro-batch through an engine of its own (dummy micro-batches too), the model the host built and
wrapped; odb's own loop has none to run."""


@dataclass(frozen=True, kw_only=True)
class ObjectiveSettings:
    """What the run trains."""

    objective: str = field(default="next_token", metadata=flag(choices=OBJECTIVES))
    """next_token: supervised fine-tuning (each record a conversation); dpo, ipo, hinge (against a
    reference), simpo, orpo (reference free): preference training, each record a prompt with a
    chosen and a rejected answer, trained as one packing unit (docs/training.md, Preference records);
    reward: a Bradley-Terry reward model on the same pairs (the model under a one-output score head,
    trained so that the chosen answer scores higher)."""
    beta: float = 0.1
    """The preference loss's beta (DPO's KL strength; IPO's tau; SimPO's reward scale; ORPO's weight
    of its odds-ratio term)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma."""
    center_rewards_coefficient: float = 0.0
    """A reward model's weight c of the centering term, each pair's loss plus c (r_c + r_r)^2, which
    draws the rewards toward mean zero (TRL RewardTrainer's center_rewards_coefficient; 0: none)."""
    reference: str | None = field(default=None, metadata=flag(choices=REFERENCES, shown_default=(
        "none for simpo, orpo and reward; adapter for a LoRA run; precompute otherwise")))
    """Where the reference log-probabilities come from (dpo, ipo, hinge): adapter (a LoRA run's base
    model, its adapter disabled), data (each record's ref_chosen_logps and ref_rejected_logps), or
    precompute (the initial weights', one forward-only pass over the training data before the first
    step, kept in --output_dir as reference_logps.npy and reused by a resume)."""

    def __post_init__(self) -> None:
        check(self.objective in OBJECTIVES, f"--objective must be one of {OBJECTIVES}, got {self.objective!r}")
        check_number("--beta", self.beta, 0)
        check(self.beta > 0, f"--beta must be > 0, got {self.beta}")
        check_number("--simpo_gamma", self.simpo_gamma, 0)
        check_number("--center_rewards_coefficient", self.center_rewards_coefficient, 0)
        check(self.reference is None or self.reference in REFERENCES + HOST_REFERENCES,
              f"--reference must be one of {REFERENCES}, got {self.reference!r}")
        check(self.scores or not self.center_rewards_coefficient,
              f"--center_rewards_coefficient {self.center_rewards_coefficient}: it centers a reward model's rewards "
              "(--objective reward); drop it")
        if self.objective == "next_token":
            return
        check(not self.scores or self.beta == 0.1,  # (the default: no --beta given)
              f"--beta {self.beta}: --objective reward has no beta (its loss is -log sigmoid(r_c - r_r)); drop it")
        free = self.objective in REFERENCE_FREE
        wanted = ("reference free: --reference none" if free
                  else "against a reference: --reference adapter, data or precompute")
        check(self.reference is None or free == (self.reference == "none"),
              f"--objective {self.objective} is {wanted}, not {self.reference!r}")

    @property
    def is_preference(self) -> bool:
        return self.objective != "next_token"

    def reference_for(self, *, lora: bool) -> str:
        """The reference a preference run uses (``--reference``, else its default)."""
        if self.reference is not None:
            return self.reference
        return "none" if self.objective in REFERENCE_FREE else "adapter" if lora else "precompute"

    @property
    def scores(self) -> bool:
        """A reward model: the model is built with a score head instead of its LM head."""
        return self.objective == "reward"


def run_scores(run: dict) -> bool:
    """Whether a saved run (its ``config.json``, as a dict) trained a reward model."""
    return (run.get("objective") or {}).get("objective") == "reward"


def padded_refusal(objective: str, padded: str) -> str:
    """Why ``--objective objective`` cannot train on padded micro-batches (``padded``: what pads
    them). A padded bin fills to ``samples x longest <= max_tokens``, a pair counted as one sample
    of its two sequences' tokens, but a pair trains as two rows, each padded to the bin's longest
    sequence: a pair of 1000 and 10 tokens alone in a bin of 1024 is 2 x 1000 tokens, twice what the
    batcher's fill rule allowed, over the hard cap (I5). (Its cost and materialized tokens count the
    two rows, :class:`odb.batching.cost.SampleCost`; the fill rule does not.)"""
    return (f"--objective {objective} trains each pair as two sequences, and {padded}: a padded micro-batch "
            "would hold each pair as two rows padded to the longer one, up to twice max_tokens (odb's padded "
            "bins fill to max_tokens counting a pair as one row); train a model odb packs, with policy odb (or "
            "the baseline fixed, which ignores max_tokens)")
