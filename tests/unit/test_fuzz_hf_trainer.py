"""odb inside HF ``Trainer`` (odb/integrations/hf.py), one process, against HF's own semantics written
out in plain torch: a whole epoch of the bundled chats through ``OdbTrainer`` (SGD, a constant
learning rate, no clipping), replayed step by step from the audit file. HF's semantics for a step
of ``gradient_accumulation_steps`` micro-batches whose loss is normalized by ``num_items_in_batch``:
the optimizer applies ``grad(sum of the step's token losses / N_step)`` once, neither divided by the
accumulation steps again nor averaged over the micro-batches. The replay computes exactly that
with the model's own eager attention and own ``labels=`` loss on each sample alone, from the same
initial weights, and applies the SGD step itself. Checked, for GAS 1, 2 and 3 and budgets that
pack 1 to about 6 samples a micro-batch:

* the host ran as many optimizer steps as odb planned (``global_step``, the audit, summary.json),
  each of GAS micro-batches;
* every weight after the epoch equals the replay's (1e-5 of its largest entry);
* each loss HF logs (``logging_steps 1``) is the step's mean token loss, ``sum / N_step``;
* the learning rate HF logs is the one the step ran at.

The same replay checks the Accelerate adapter's documented loop (odb/integrations/accelerate.py),
over a model loaded as a user loads one (transformers' own attention: odb_run switches it), with
odb's schedule moving the rate from step to step.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

from conftest import ROOT, bundled_tokenizer
from odb.batching.config import OdbConfig
from odb.integrations import OdbSettings
from odb.integrations.hf import OdbTrainer
from odb.training.config.settings import DataSettings

LR, RTOL = 0.05, 1e-5
CASES = [(1, 96), (2, 160), (3, 256)]  # (gradient_accumulation_steps, max_tokens)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(vocab: int):
    config = AutoConfig.for_model(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  initializer_range=0.2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def own_loss_sum(model, sample: dict) -> torch.Tensor:
    labels = torch.as_tensor(sample["labels"]).reshape(1, -1).clone()
    labels[0, 0] = -100
    count = int((labels[0, 1:] != -100).sum())
    if not count:
        return torch.zeros(())
    ids = torch.as_tensor(sample["input_ids"]).reshape(1, -1)
    return model(input_ids=ids, labels=labels, use_cache=False).loss * count


@pytest.mark.parametrize("gas,max_tokens", CASES)
def test_an_epoch_under_hf_trainer_is_hfs_sgd_on_each_steps_samples_over_its_label_tokens(tmp_path, gas, max_tokens):
    tokenizer = bundled_tokenizer()
    model = tiny_model(len(tokenizer))
    replay = copy.deepcopy(model)
    settings = OdbSettings(data=DataSettings(path=str(ROOT / "data" / "chat.jsonl"), max_samples=24, num_workers=0),
                           batching=OdbConfig(max_tokens=max_tokens, window=16), audit_ids=True,
                           tokenizer=str(ROOT / "data" / "tokenizer"))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=gas,
                             num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant", optim="sgd",
                             weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, report_to=[], logging_steps=1,
                             save_strategy="no", disable_tqdm=True)
    trainer = OdbTrainer(model=model, args=args, processing_class=tokenizer, odb=settings)
    trainer.train()
    dataset = trainer.odb_run.parts.dataset
    rows = [json.loads(line) for line in (tmp_path / "emitted_ids.rank0.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in rows})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert trainer.state.global_step == len(steps) == summary["steps"] > 1
    assert all(sum(r["step"] == s for r in rows) == gas for s in steps), "a step of other than GAS micro-batches"

    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "train_loss" not in entry]
    assert len(logged) == len(steps)
    with torch.no_grad():
        for p in replay.parameters():
            p.grad = None
    for step, entry in zip(steps, logged, strict=True):
        samples = [dataset[i] for r in rows if r["step"] == step for i in r["ids"]]
        total = sum((own_loss_sum(replay, s) for s in samples), torch.zeros(()))
        n_step = sum(int((torch.as_tensor(s["labels"])[1:] != -100).sum()) for s in samples)
        assert n_step > 0
        (total / n_step).backward()
        with torch.no_grad():
            for p in replay.parameters():
                p -= LR * p.grad
                p.grad = None
        assert entry["loss"] == pytest.approx(float(total) / n_step, rel=1e-4), step
        assert entry["learning_rate"] == pytest.approx(LR)
    initial = tiny_model(len(tokenizer)).parameters()
    moved = max(float((a - b).abs().max()) for a, b in zip(replay.parameters(), initial, strict=True))
    print(f"GAS {gas}, max_tokens {max_tokens}: {len(steps)} steps of {len(rows) / len(steps):.0f} micro-batches, "
          f"{sum(len(r['ids']) for r in rows)} samples; the weights moved up to {moved:.2e}")
    assert moved > 1e-3
    theirs = dict(replay.named_parameters())
    for name, weight in trainer.model.named_parameters():
        want = theirs[name].detach()
        diff = float((weight.detach() - want).abs().max())
        assert diff <= RTOL * float(want.abs().max()), f"GAS {gas}: {name} off by {diff:.2e} after {len(steps)} steps"


@pytest.mark.parametrize("gas,max_tokens", CASES[1:])
def test_an_epoch_of_an_accelerate_loop_is_sgd_on_each_steps_samples_over_its_label_tokens(tmp_path, gas, max_tokens):
    """The Accelerate adapter (odb/integrations/accelerate.py) in its documented loop, one process:
    every step's update is ``step.lr`` times ``grad(sum of its token losses / N_step)``, replayed."""
    from accelerate import Accelerator

    from odb.integrations.accelerate import backward, odb_run, set_lr

    tokenizer = bundled_tokenizer()
    model = tiny_model(len(tokenizer))
    replay = copy.deepcopy(model)
    settings = OdbSettings(data=DataSettings(path=str(ROOT / "data" / "chat.jsonl"), max_samples=24, num_workers=0),
                           batching=OdbConfig(max_tokens=max_tokens, window=16, gas=gas),
                           tokenizer=str(ROOT / "data" / "tokenizer"))
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    run = odb_run(accelerator, model, settings, lr=LR, output_dir=tmp_path, warmup_ratio=0.2)
    dataset, trained = run.parts.dataset, []
    try:
        for step in run.steps():
            set_lr(optimizer, step.lr)
            for micro in step.micro_batches:
                backward(accelerator, model, micro)
            optimizer.step()
            optimizer.zero_grad()
            trained.append((step.lr, [dataset[s.uid % len(dataset)] for m in step.plan.micro_batches
                                      for s in m.samples]))
            assert len(step.micro_batches) == gas
            step.end()
        run.finish()
    finally:
        run.close()
    assert len(trained) > 1 and len({lr for lr, _ in trained}) > 1  # (warmup and decay: the rate moves)
    for lr, samples in trained:
        total = sum((own_loss_sum(replay, s) for s in samples), torch.zeros(()))
        n_step = sum(int((torch.as_tensor(s["labels"])[1:] != -100).sum()) for s in samples)
        (total / n_step).backward()
        with torch.no_grad():
            for p in replay.parameters():
                p -= lr * p.grad
                p.grad = None
    theirs = dict(replay.named_parameters())
    for name, weight in accelerator.unwrap_model(model).named_parameters():
        want = theirs[name].detach()
        diff = float((weight.detach() - want).abs().max())
        assert diff <= RTOL * float(want.abs().max()), f"GAS {gas}: {name} off by {diff:.2e} after {len(trained)} steps"
