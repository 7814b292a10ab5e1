"""``save_hf`` inside a live DeepSpeed ZeRO-3 run on 2 CPU ranks (gloo); tests/e2e/test_export.py
launches it and checks what it reports:

    torchrun --nproc_per_node 2 tests/e2e/save_hf_worker.py OUT

For full fine-tuning and for LoRA, on the tiny model with every parameter partitioned
(``stage3_param_persistence_threshold: 0``): one training step, the engine's own forward on a held
batch (ZeRO-3 gathers each layer itself), ``save_hf`` (merged; for LoRA also ``adapter_only``),
then the engine's forward again and one more step (the run goes on). Rank 0 writes
``OUT/report.json`` with the largest logit differences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.export import save_hf  # noqa: E402
from odb.training.model.build import build_model, load_tokenizer  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.loss import token_loss_sum  # noqa: E402

TINY = ROOT / "configs" / "tiny_model.json"
DS_CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "steps_per_print": 1000000}


def train_step(engine, rank: int, step: int) -> None:
    engine.train()
    gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
    ids = torch.randint(5, 1000, (1, 48), generator=gen)
    engine.backward(token_loss_sum(engine(input_ids=ids, use_cache=False).logits, ids) / 47)
    engine.step()


@torch.no_grad()
def logits(model, held: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=held, use_cache=False).logits.float()


def plain_model(path: Path, *, seed: int | None = None):
    """The tiny model with transformers' default attention: seeded random init, or a saved folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if seed is None:
        return AutoModelForCausalLM.from_pretrained(str(path)).eval()
    torch.manual_seed(seed)  # as build_model: the same init, so the same frozen LoRA base
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(path.read_text()))).eval()


def main(out: Path) -> None:
    import deepspeed
    import torch.distributed as dist
    from peft import PeftModel

    deepspeed.init_distributed()
    rank = dist.get_rank()
    tokenizer = load_tokenizer(ROOT / "data" / "tokenizer")
    held = torch.randint(5, 1000, (1, 64), generator=torch.Generator().manual_seed(7))  # one row: odb_varlen
    lora = json.loads((ROOT / "configs" / "lora.json").read_text())
    report: dict[str, float | bool] = {}
    for name, settings in (("full", None), ("lora", lora)):
        model = build_model(TINY, seed=0, vocab_size=len(tokenizer), lora=settings)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=DS_CONFIG,
                                          optimizer=torch.optim.AdamW(params, lr=1e-2))
        train_step(engine, rank, 0)
        report[f"{name}_partitioned"] = all(p.numel() == 0 for p in engine.module.parameters())
        expected = logits(engine, held)  # (leaves the parameters gathered: save_hf partitions them first)
        for adapter_only in (False, True) if settings else (False,):
            folder = out / (name + ("_adapter" if adapter_only else ""))
            save_hf(DeepSpeedBackend(engine), model_path=TINY, lora=settings, tokenizer=tokenizer, out=folder,
                    adapter_only=adapter_only)
            written = folder / ("adapter_model.safetensors" if adapter_only else "model.safetensors")
            report[f"{folder.name}_written_on_rank{rank}"] = written.is_file()  # rank 0 wrote before any returned
            if rank == 0:
                saved = (PeftModel.from_pretrained(plain_model(TINY, seed=0), str(folder)) if adapter_only
                         else plain_model(folder))
                report[f"{folder.name}_max_diff"] = float((logits(saved, held) - expected).abs().max())
        report[f"{name}_unchanged_max_diff"] = float((logits(engine, held) - expected).abs().max())
        train_step(engine, rank, 1)  # training goes on after the save
        report[f"{name}_trained_on_max_diff"] = float((logits(engine, held) - expected).abs().max())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        merged = {k: v for rank_report in gathered for k, v in rank_report.items()}
        (out / "report.json").write_text(json.dumps(merged, indent=2))
    # left to the interpreter's exit, gloo's threads were destroyed still running now and then
    # ("terminate called without an active exception", exit -6; seen once on a loaded machine)
    dist.destroy_process_group()
    release()


if __name__ == "__main__":
    main(Path(sys.argv[-1]))
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
