"""``build_model`` at ZeRO-3 on 2 CPU ranks (gloo), launched and checked by tests/e2e/test_big_models.py:

    torchrun --nproc_per_node 2 tests/e2e/big_models_worker.py OUT

Every parameter partitioned (``stage3_param_persistence_threshold: 0``). For the tiny text model,
with LoRA, and the tiny Qwen2-VL model: the model built partitioned (random init, and a saved
folder) against the same model built whole on this rank, gathered tensor by tensor; the precision
of a bf16 / fp16 DeepSpeed config; then one SGD step on a packed row (odb's varlen attention) with
and without activation checkpointing at ZeRO-3. Rank 0 writes ``OUT/report.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from odb.data.collate import collate_packed  # noqa: E402
from odb.training.backends import deepspeed as ds_backend  # noqa: E402
from odb.training.model.build import build_model  # noqa: E402
from odb.training.model.mrope import packed_position_ids  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402

TINY = ROOT / "configs" / "tiny_model.json"
VL = ROOT / "configs" / "tiny_vl_model.json"
LORA = json.loads((ROOT / "configs" / "lora.json").read_text())
VOCAB = 1000
ZERO3 = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "gradient_clipping": 0.0,
         "zero_allow_untested_optimizer": True, "steps_per_print": 1000000}
MODELS = {"text": (TINY, None), "text_lora": (TINY, LORA), "vl": (VL, None)}


def gathered(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (one at a time under ZeRO-3)."""
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.data.detach().clone().float()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def is_partitioned(model) -> bool:
    """Every base weight a ZeRO-3 partition with nothing whole left here (LoRA's own weights are
    partitioned later, by ``deepspeed.initialize``)."""
    return all(hasattr(p, "ds_id") and p.data.numel() == 0 for n, p in model.named_parameters() if "lora_" not in n)


def compare_builds(path: Path, lora, report: dict, name: str) -> None:
    from transformers.integrations import is_deepspeed_zero3_enabled

    whole = build_model(path, seed=0, vocab_size=VOCAB, lora=lora)
    expected, draws_after_whole = gathered(whole), torch.rand(4)
    parted = ds_backend.build_model(path, seed=0, vocab_size=VOCAB, lora=lora, ds_config=ZERO3)
    report[f"{name}_same_random_stream"] = torch.equal(torch.rand(4), draws_after_whole)
    report[f"{name}_partitioned"] = is_partitioned(parted)
    report[f"{name}_max_diff"] = max_diff(gathered(parted), expected)
    report[f"{name}_zero3_flag_left_on"] = is_deepspeed_zero3_enabled()


def compare_folders(out: Path, report: dict, rank: int) -> None:
    """A saved model (text, with LoRA on top; Qwen2-VL) loaded partitioned, against it loaded whole."""
    import torch.distributed as dist

    for name, path, lora in (("folder", TINY, LORA), ("vl_folder", VL, None)):
        folder = out / name
        if rank == 0:
            build_model(path, seed=5, vocab_size=VOCAB).save_pretrained(folder)
        dist.barrier()
        expected = gathered(build_model(folder, seed=0, vocab_size=VOCAB))
        parted = ds_backend.build_model(folder, seed=0, vocab_size=VOCAB, lora=lora, ds_config=ZERO3)
        report[f"{name}_partitioned"] = is_partitioned(parted)
        loaded = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                  for k, v in gathered(parted).items() if "lora_" not in k}
        report[f"{name}_max_diff"] = max_diff(loaded, expected)


def precisions(report: dict) -> None:
    for name, extra in (("bf16_zero3", {"bf16": {"enabled": True}}), ("fp16_zero3", {"fp16": {"enabled": True}}),
                        ("bf16_zero2", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})):
        model = ds_backend.build_model(TINY, seed=0, vocab_size=VOCAB, ds_config={**ZERO3, **extra})
        report[f"{name}_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        report[f"{name}_partitioned"] = is_partitioned(model)


def packed_row(path: Path, model, rank: int) -> dict:
    """Three samples of this rank packed in one row; for the VL model the first holds an image."""
    gen = torch.Generator().manual_seed(rank)
    samples = [{"input_ids": torch.randint(10, VOCAB, (n,), generator=gen).tolist()} for n in (23, 9, 31)]
    for sample in samples:
        sample["labels"] = list(sample["input_ids"])
    if path != VL:
        return collate_packed(samples)
    config = model.config
    samples[0]["input_ids"][3:9] = [config.vision_start_token_id, *[config.image_token_id] * 4,
                                    config.vision_end_token_id]  # a 1 x 4 x 4 patch grid, merged 2 x 2
    batch = collate_packed(samples)
    batch["pixel_values"] = torch.randn(16, 3 * 2 * 14 * 14, generator=gen)
    batch["image_grid_thw"] = torch.tensor([[1, 4, 4]])
    batch["position_ids"] = packed_position_ids(model, batch["input_ids"], batch["cu_seq_lens_q"],
                                                batch["image_grid_thw"])
    return batch


def one_step(path: Path, lora, rank: int, checkpointing: bool) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The weights after one SGD step at ZeRO-3, and how often the first layer's MLP (and the
    first vision block's) started."""
    import deepspeed

    model = ds_backend.build_model(path, seed=0, vocab_size=VOCAB, lora=lora, ds_config=ZERO3,
                        gradient_checkpointing=checkpointing)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    watched = {"layer": getattr(base.model, "language_model", base.model).layers[0].mlp}
    if hasattr(base.model, "visual"):
        watched["vision_block"] = base.model.visual.blocks[0].mlp
    calls = dict.fromkeys(watched, 0)
    for key, module in watched.items():  # pre-hooks: a recomputation stops once it has what backward needs
        module.register_forward_pre_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ZERO3,
                                      optimizer=torch.optim.SGD(params, lr=100.0))
    batch = packed_row(path, base, rank)
    labels = batch.pop("labels")
    logits = engine(**batch, use_cache=False).logits
    loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], reduction="sum") / labels.numel()
    engine.backward(loss)
    engine.step()
    return gathered(engine.module), calls


def compare_checkpointing(report: dict, rank: int) -> None:
    for name, (path, lora) in MODELS.items():
        before = gathered(build_model(path, seed=0, vocab_size=VOCAB, lora=lora))
        plain, plain_calls = one_step(path, lora, rank, checkpointing=False)
        checkpointed, checkpointed_calls = one_step(path, lora, rank, checkpointing=True)
        moved = {k: (plain[k] - before[k]).abs().max() for k in plain}
        report[f"checkpointing_{name}_tensors_moved"] = sum(int(m > 0) for m in moved.values())
        report[f"checkpointing_{name}_max_rel_diff"] = max(
            float((checkpointed[k] - plain[k]).abs().max() / m) for k, m in moved.items() if m > 0)
        report[f"checkpointing_{name}_unmoved_max_diff"] = max(
            [float((checkpointed[k] - before[k]).abs().max()) for k, m in moved.items() if m == 0] or [0.0])
        report[f"checkpointing_{name}_calls"] = {"plain": plain_calls, "checkpointed": checkpointed_calls}


def main(out: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed()
    rank = dist.get_rank()
    report: dict = {}
    for name, (path, lora) in MODELS.items():
        compare_builds(path, lora, report, name)
    compare_folders(out, report, rank)
    precisions(report)
    compare_checkpointing(report, rank)
    gathered_reports = [None] * dist.get_world_size()
    dist.all_gather_object(gathered_reports, report)
    if rank == 0:
        (out / "report.json").write_text(json.dumps(gathered_reports, indent=2))
    dist.destroy_process_group()  # (not left to the interpreter's exit: see save_hf_worker.py)
    ds_backend.release()


if __name__ == "__main__":
    main(Path(sys.argv[-1]))
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
