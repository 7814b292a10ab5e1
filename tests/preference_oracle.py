"""The oracle of odb's preference objectives (odb.training.step.preference), shared by
tests/unit/test_preference_loss.py and tests/e2e/preference_ranks_worker.py: pair samples as
odb.data.preference makes them, each sequence's log-probability alone through a plain model (its
own logits, log-softmax summed over the answer's labels), and TRL's own loss code on one pair
(CPOTrainer.cpo_loss for sigmoid, IPO, hinge and SimPO, ORPOTrainer.odds_ratio_loss for ORPO's
odds ratio; RewardTrainer.compute_loss for a reward model, on the pair's two rows padded as its
collator pads them). Nothing here calls odb."""

from __future__ import annotations

import os
import random
from collections import defaultdict
from types import SimpleNamespace

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl import RewardTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

__all__ = ["alone_logps", "answer_tokens", "pair", "trl_loss", "trl_reward_loss"]


def pair(rng: random.Random, uid: int, *, ref: bool, vocab: int = 1024) -> dict:
    """A pair sample as odb.data.preference makes one: chosen then rejected, each prompt + answer,
    labels on the answer; lengths very uneven. ``ref``: with random reference log-probs."""
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))]
    seqs = []
    for _ in range(2):
        answer = [rng.randrange(3, vocab) for _ in range(rng.choice([1, 3, 9, 40]))]
        seqs.append((prompt + answer, [-100] * len(prompt) + answer))
    sample = {"uid": uid, "index": uid, "source": 0, "input_ids": torch.tensor(seqs[0][0] + seqs[1][0]),
              "labels": torch.tensor(seqs[0][1] + seqs[1][1]), "pair": (len(seqs[0][0]), len(seqs[1][0]))}
    if ref:
        sample["ref_logps"] = (-rng.uniform(5, 200), -rng.uniform(5, 200))
    return sample


def alone_logps(model, sample: dict) -> list[torch.Tensor]:
    """A pair's two log-probabilities, each sequence alone through ``model`` (chosen, rejected)."""
    chosen = sample["pair"][0]
    out = []
    for ids, labels in ((sample["input_ids"][:chosen], sample["labels"][:chosen]),
                        (sample["input_ids"][chosen:], sample["labels"][chosen:])):
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        targets = labels[1:]
        scored = targets != -100
        out.append(torch.log_softmax(logits, -1)[scored].gather(1, targets[scored][:, None]).sum())
    return out


def answer_tokens(sample: dict) -> list[int]:
    """Each answer's scored label tokens (a sequence's first position never is)."""
    chosen = sample["pair"][0]
    labels = sample["labels"].tolist()
    return [sum(1 for t in side[1:] if t != -100) for side in (labels[:chosen], labels[chosen:])]


def trl_loss(loss: str, beta: float, gamma: float, pi, rho, n) -> torch.Tensor:
    """TRL's own loss of one pair from its log-probabilities ``pi``, the reference's ``rho`` (None:
    reference free) and the answers' label tokens ``n`` (each chosen, rejected)."""
    trainer = SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=0.0, simpo_gamma=gamma,
                              accelerator=SimpleNamespace(device="cpu"))
    if loss == "orpo":
        mean = [pi[0] / n[0], pi[1] / n[1]]
        ratio = ORPOTrainer.odds_ratio_loss(trainer, mean[0][None], mean[1][None])[0]
        return -mean[0] - ratio[0]  # ORPO: the chosen answer's mean NLL minus beta log sigmoid(log odds)
    trainer.loss_type = {"dpo": "sigmoid", "ipo": "ipo", "hinge": "hinge", "simpo": "simpo"}[loss]
    if loss == "simpo":
        chosen, rejected = pi[0] / n[0], pi[1] / n[1]
    elif loss == "ipo":  # TRL's DPO IPO: the log ratios per answer token
        chosen, rejected = (pi[0] - rho[0]) / n[0], (pi[1] - rho[1]) / n[1]
    else:
        chosen, rejected = pi[0] - rho[0], pi[1] - rho[1]
    return CPOTrainer.cpo_loss(trainer, chosen[None], rejected[None])[0][0]


def trl_reward_loss(model, sample: dict, pad_token_id: int = 0, center: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's RewardTrainer loss of one pair (``model``: a sequence classifier, one label) and the
    two rewards: its ``compute_loss`` on the chosen and the rejected rows padded on the right to the
    longer (the model's own class pools each row's last token that is not its config's
    ``pad_token_id``); ``center``: its ``center_rewards_coefficient``; a sample's ``margin``, its
    margin column."""
    chosen = sample["pair"][0]
    rows = [sample["input_ids"][:chosen], sample["input_ids"][chosen:]]
    longest = max(map(len, rows))
    input_ids = torch.full((2, longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((2, longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)], mask[i, :len(row)] = row, 1
    same = lambda x: x  # noqa: E731 (one process: nothing to gather)
    trainer = SimpleNamespace(model=model, args=SimpleNamespace(center_rewards_coefficient=center), _tp_size=1,
                              accelerator=SimpleNamespace(gather=same, gather_for_metrics=same),
                              _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0)
    inputs = {"input_ids": input_ids, "attention_mask": mask}
    if "margin" in sample:  # (TRL's margin column, one per pair)
        inputs["margin"] = torch.tensor([sample["margin"]])
    loss, outputs = RewardTrainer.compute_loss(trainer, model, inputs, return_outputs=True)
    return loss, outputs.logits[:, 0].detach()
