"""odb.integrations without a process: what the host's arguments mean under odb (each kept or
refused naming odb's setting), the RunConfig of a host's run, and the schedule shapes the host's
lr_scheduler_type maps to (against their closed forms)."""

import dataclasses
import math

import pytest

from odb.batching.config import OdbConfig
from odb.data.mixture import SourceSpec
from odb.integrations import OdbSettings, host_config
from odb.training.config.settings import DataSettings
from odb.training.run.schedule import ProgressSchedule

SETTINGS = OdbSettings(data=DataSettings(path="data/chat.jsonl"), batching=OdbConfig(max_tokens=1024))


def arguments(**values):
    from transformers import TrainingArguments

    return TrainingArguments(**{"output_dir": "unused", "use_cpu": True, "report_to": [], **values})


@pytest.mark.parametrize("values,names", [
    ({"per_device_train_batch_size": 4}, "max_tokens"),
    ({"lr_scheduler_type": "polynomial"}, "cosine_with_min_lr"),
    ({"warmup_steps": 10}, "ratio < 1"),
    ({"num_train_epochs": 1.5}, "whole number"),
    ({"save_steps": 0.1}, "whole steps"),
    ({"auto_find_batch_size": True}, "max_tokens"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0"),
])
def test_a_host_argument_odb_cannot_keep_is_refused_naming_odbs_setting(values, names):
    from odb.integrations.hf import check_arguments

    with pytest.raises(ValueError, match=names):
        check_arguments(arguments(**values), SETTINGS)


def test_a_loss_the_host_would_compute_otherwise_is_refused_naming_the_setting(tmp_path):
    """odb backs its own loss for every micro-batch (OdbTrainerMixin.compute_loss), so a host setting
    that changes the loss would be dropped without a word: HF's label smoothing (above), TRL's
    loss_type 'dft' (which TRL runs as a compute_loss_func), a compute_loss_func of one's own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import SFTConfig

    from odb.integrations.hf import OdbTrainer, check_arguments

    dft = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], loss_type="dft")
    with pytest.raises(ValueError, match="loss_type='nll'"):
        check_arguments(dft, SETTINGS)
    config = AutoConfig.for_model(model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="drop compute_loss_func"):
        OdbTrainer(model=model, args=arguments(output_dir=str(tmp_path)), odb=SETTINGS,
                   compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)


def test_the_host_defaults_and_odbs_own_values_pass():
    from odb.integrations.hf import check_arguments

    check_arguments(arguments(), SETTINGS)  # per_device_train_batch_size 8 left as is, linear, no warmup
    check_arguments(arguments(per_device_train_batch_size=1, gradient_accumulation_steps=4, warmup_steps=0.03,
                              lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}),
                    SETTINGS)


def test_odbs_gas_is_the_hosts_gradient_accumulation_steps():
    common = {"model_path": "m", "output_dir": "o", "lr": 1e-5, "warmup_ratio": 0.0, "weight_decay": 0.0, "epochs": 2}
    config = host_config(SETTINGS, gas=4, **common)
    assert config.batching.gas == 4 and config.run.epochs == 2 and config.preflight.preflight == "off"
    assert config.model.tokenizer == "m"  # the model's folder, unless OdbSettings names one
    other = OdbSettings(data=SETTINGS.data, batching=OdbConfig(max_tokens=1024, gas=2))
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        host_config(other, gas=4, **common)
    auto = OdbSettings(data=SETTINGS.data, batching=OdbConfig(max_tokens="auto"))
    with pytest.raises(ValueError, match="preflight"):
        host_config(auto, gas=1, **common)
    held_out = OdbSettings(data=DataSettings(path="data/chat.jsonl", val_ratio=0.1), batching=SETTINGS.batching)
    with pytest.raises(ValueError, match="eval_dataset"):
        host_config(held_out, gas=1, **common)
    sources = (SourceSpec("a", "p", 1.0), SourceSpec("b", "q", 2.0))
    weighted = OdbSettings(data=DataSettings(path="m", sources=sources, mix_epoch="first"), batching=SETTINGS.batching)
    assert host_config(weighted, gas=1, **common).data.sources == sources  # the host plans with odb's bound
    streaming = OdbSettings(data=DataSettings(path="data/chat.jsonl", streaming=True), batching=SETTINGS.batching)
    with pytest.raises(ValueError, match="streaming source"):
        host_config(streaming, gas=1, **common)
    tokens = OdbSettings(data=SETTINGS.data, batching=OdbConfig(max_tokens=1024, global_batch_tokens=8192))
    with pytest.raises(ValueError, match="global_batch_tokens derives odb's gas, and the host owns"):
        host_config(tokens, gas=4, **common)
    unnamed = {**common, "model_path": "host model"}  # (a model built from a config: no folder)
    with pytest.raises(ValueError, match="OdbSettings.tokenizer"):
        host_config(SETTINGS, gas=1, **unnamed)
    assert host_config(dataclasses.replace(SETTINGS, tokenizer="data/tokenizer"), gas=1, **unnamed)
    fsdp = host_config(SETTINGS, gas=1, backend="fsdp2", **common)
    assert fsdp.optimization.fsdp2 is not None and not fsdp.optimization.deepspeed


@pytest.mark.parametrize("decay", ["linear", "cosine", "constant"])
def test_each_decay_is_its_closed_form_over_the_samples_trained(decay):
    lr, total, warmup, floor = 2e-4, 1000, 0.1, 0.1
    schedule = ProgressSchedule(lr, total, warmup_ratio=warmup, min_ratio=floor, decay=decay)
    for done in (0, 50, 100, 400, 1000):
        p = done / total
        if p < warmup:
            expected = lr * max(p / warmup, 1e-3)
        else:
            gone = (p - warmup) / (1 - warmup)
            shape = {"linear": 1 - gone, "cosine": (1 + math.cos(math.pi * gone)) / 2, "constant": None}[decay]
            expected = lr if shape is None else lr * (floor + (1 - floor) * shape)
        assert schedule(done) == pytest.approx(expected, rel=1e-12), done
    with pytest.raises(ValueError, match="decays"):
        ProgressSchedule(lr, total, decay="step")


def test_the_hosts_evaluation_of_padded_batches_is_the_models_own_loss(tmp_path):
    """OdbTrainer switches the model to odb's attention; HF's evaluate on the host's own padded
    batches still gives the model's own loss, as the same weights through SDPA give it."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorWithPadding

    from odb.integrations.hf import OdbTrainer

    config = AutoConfig.for_model(model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    oracle = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    oracle.load_state_dict(model.state_dict())
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    data = Dataset.from_dict({"input_ids": rows, "labels": rows})

    class Pad(DataCollatorWithPadding):
        def __call__(self, features):
            longest = max(len(f["input_ids"]) for f in features)
            ids = torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features])
            mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"])) for f in features])
            return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    trainer = OdbTrainer(model=model, args=arguments(per_device_eval_batch_size=2, output_dir=str(tmp_path)),
                         odb=SETTINGS, data_collator=Pad(tokenizer=None))
    assert model.config._attn_implementation != "sdpa"  # odb's, for the packed training rows
    loss = trainer.evaluate(eval_dataset=data)["eval_loss"]
    batch = Pad(tokenizer=None)([{"input_ids": r} for r in rows])
    with torch.no_grad():
        expected = oracle.eval()(**batch).loss.item()
    assert loss == pytest.approx(expected, rel=1e-5)


def test_the_hosts_schedule_arguments_become_odbs_schedule_by_progress():
    from odb.integrations.hf import schedule

    floor = schedule(arguments(learning_rate=1e-4, lr_scheduler_type="cosine_with_min_lr",
                               lr_scheduler_kwargs={"min_lr": 1e-5}, warmup_steps=0.1), 100)
    assert (floor.min_ratio, floor.decay, floor.warmup_ratio) == (pytest.approx(0.1), "cosine", 0.1)
    assert floor(100) == pytest.approx(1e-5)
    constant = schedule(arguments(learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0.1), 100)
    assert constant(0) == constant(50) == 1e-4  # HF's constant has no warmup
    linear = schedule(arguments(learning_rate=1e-4), 100)  # HF's default: linear to 0, no warmup
    assert (linear(0), linear(50), linear(100)) == (1e-4, pytest.approx(5e-5), 0.0)


def test_deepspeeds_autotuner_gets_no_mlflow_and_everything_else_does():
    """odb/imports.py: the import DeepSpeed's autotuner makes at DeepSpeed's import fails (as where
    mlflow is not installed); the same import anywhere else, odb's tracker's, succeeds."""
    import importlib.util
    import os
    import sys

    import odb  # noqa: F401 (installs the finder)

    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed")
    saved = sys.modules.pop("mlflow", None)  # (an import of a loaded module asks no finder)
    try:
        autotuner = compile("try:\n    import mlflow\n    has = True\nexcept ImportError:\n    has = False\n",
                            os.path.join("site-packages", "deepspeed", "autotuning", "autotuner.py"), "exec")
        scope: dict = {}
        exec(autotuner, scope)
        assert scope["has"] is False and "mlflow" not in sys.modules
        mlflow = importlib.import_module("mlflow")
        assert mlflow.MlflowClient is not None
    finally:
        if saved is not None:
            sys.modules["mlflow"] = saved


def test_a_trl_trainer_of_another_objective_is_refused_and_sft_is_kept():
    """with_odb(KTOTrainer) would back next-token loss under KTO's name: refused, naming odb's
    preference objectives; SFTTrainer (and HF's Trainer) keep working (DPO, CPO, ORPO:
    tests/unit/test_integrations_dpo.py; reward: tests/unit/test_integrations_reward.py)."""
    import os

    from transformers import Trainer
    from trl import SFTTrainer

    from odb.integrations.hf import with_odb

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.kto import KTOTrainer

    with pytest.raises(TypeError, match="with_odb\\(RewardTrainer\\) or odb's own loop"):
        with_odb(KTOTrainer)
    assert with_odb(SFTTrainer).__name__ == "OdbSFTTrainer" and with_odb(Trainer).__name__ == "OdbTrainer"
