"""Hugging Face models from a run: a folder that ``from_pretrained`` loads without odb.

Two doors, one writer:

* :func:`save_hf` (collective) gathers the live model's weights on rank 0 through its training
  backend (DeepSpeed at any ZeRO stage, or FSDP2), in the training precision;
* :func:`export_checkpoint` (one process, no process group) rebuilds the fp32 weights from a saved
  checkpoint (``OUTPUT_DIR/checkpoints/<tag>``) through the backend that saved it (DeepSpeed's
  ``zero_to_fp32``, FSDP2's DCP folder);
* both hand a full state dict (keys as ``engine.module.state_dict()`` names them) to one writer,
  which builds an empty model on the ``meta`` device, *assigns* the weights to it (no second copy),
  and saves with ``save_pretrained`` (safetensors):

      full fine-tuning     -> the model
      LoRA                 -> base + adapter merged (plain AutoModelForCausalLM loads it), or with
                              ``adapter_only`` the PEFT adapter (PeftModel.from_pretrained(base, out))

  A merged LoRA export of a model whose LM head shares its weight with the input embeddings
  (``tie_word_embeddings``), where LoRA adapts the head or the embeddings (``target_modules`` or
  ``modules_to_save`` naming ``lm_head``), is saved untied: training changed one and not the other,
  so the head gets its own tensor and the saved config says ``tie_word_embeddings: false``.

  A reward model (``--objective reward``) saves as the family's ``...ForSequenceClassification``
  (``AutoModelForSequenceClassification.from_pretrained(out)`` loads it: ``num_labels`` 1, the
  ``pad_token_id`` training pooled by, the model's own or else the tokenizer's, by which it finds
  each padded row's last token), its LoRA with
  PEFT's ``SEQ_CLS`` task (the score head trained whole, merged or in the adapter);

  plus the tokenizer, and for a vision-language model (its config has ``vision_config``) the image
  processor odb trained with (``AutoImageProcessor.from_pretrained(out)``) and, for one that takes
  videos, its video processor settings (``video_preprocessor_config.json``: frames sampled, pixel
  bounds, as the run had them; ``AutoVideoProcessor`` loads it where torchvision is installed).

The saved config has ``use_cache`` back on (training turns it off) and no attention implementation:
the model loads with transformers' default attention, not odb's ``"odb_varlen"``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from odb.data.images import VisionSpec, vision_spec_for
from odb.data.processing import DataConfig
from odb.training import backends
from odb.training.config.objective import run_scores
from odb.training.model.build import auto_class, hf_model, load_tokenizer

__all__ = ["consolidated_state_dict", "export_checkpoint", "find_checkpoint", "save_hf", "write_hf"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: pass one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def save_hf(backend, *, model_path: str | Path, lora: dict[str, Any] | None, tokenizer: Any, out: str | Path,
            adapter_only: bool = False, dtype: torch.dtype | str | None = None,
            vision: VisionSpec | None = None) -> None:
    """Saves the live model as a Hugging Face folder ``out`` (collective: every rank calls it).

    Rank 0 gathers the weights (the backend's ``full_state_dict``: ZeRO-3's partitions gathered module
    by module under DeepSpeed, the shards gathered under FSDP2; with ``adapter_only`` only the
    trainable ones) and writes ``out`` (:func:`write_hf`); every rank returns once it has, and
    raises if rank 0 failed. The live model and its training continue unchanged.

    Args:
        backend: the run's :class:`odb.training.backends.Backend` (``OdbEngine.backend``).
        model_path: the run's ``--model`` (a config JSON or an HF folder): the config to save.
        lora: the run's LoRA settings, or None for full fine-tuning.
        tokenizer: the training tokenizer, or its folder.
        out: the folder to write.
        adapter_only: LoRA: save the adapter instead of the merged model.
        dtype: of the saved weights (default: the training precision).
        vision: the run's image processor (:func:`odb.training.model.build.vision_spec`) for a
            vision-language model; default: the model's own, with its own pixel bounds.
    """
    import torch.distributed as dist
    from peft import PeftModel

    _check_adapter(adapter_only, lora)
    module = backend.module
    scores = _is_score_model(hf_model(module))
    if isinstance(module, PeftModel) != (lora is not None):
        raise ValueError("save_hf: pass lora=config.model.lora, the run's LoRA settings (None: full fine-tuning); "
                         f"the engine's model is {'' if isinstance(module, PeftModel) else 'not '}a PEFT model")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    state_dict = backend.full_state_dict(dtype=_as_dtype(dtype), trainable_only=adapter_only)
    error = None
    if rank == 0:
        try:
            write_hf(state_dict, model_path=model_path, lora=lora, tokenizer=tokenizer, out=out,
                     adapter_only=adapter_only, vision=vision, score_head=scores)
        except Exception as exc:  # told to every rank below, then raised here
            error = exc
    if distributed:  # the barrier: every rank learns whether rank 0 wrote ``out``
        message = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(message, src=0)
        if rank != 0 and message[0] is not None:
            raise RuntimeError(f"save_hf: rank 0 failed to write {out}: {message[0]}")
    if error is not None:
        raise error


def write_hf(state_dict: dict[str, torch.Tensor], *, model_path: str | Path, lora: dict[str, Any] | None,
             tokenizer: Any, out: str | Path, adapter_only: bool = False, dtype: torch.dtype | None = None,
             vision: VisionSpec | None = None, score_head: bool = False) -> Path:
    """Writes ``out`` from a full state dict (one process). Consumes ``state_dict``: its tensors
    become the saved model's (cast to ``dtype`` after any LoRA merge), and the dict is emptied.

    Args:
        state_dict: as ``engine.module.state_dict()`` names the weights (PEFT names under LoRA);
            with ``adapter_only`` the trainable ones suffice.
        model_path / lora / tokenizer / out / adapter_only / vision: as :func:`save_hf`.
        dtype: of the saved weights (default: as given).
        score_head: a reward model's weights (:func:`odb.training.model.build.build_model`).

    Returns:
        ``out``.
    """
    out = Path(out)
    _check_adapter(adapter_only, lora)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    config = _export_config(model_path)
    if score_head:  # (the pad token it pooled by in training: the model's own, else the tokenizer's)
        config.num_labels = 1
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
    model = _empty_model(config, lora, model_path, score_head=score_head)
    untie = lora is not None and not adapter_only and _adapts_tied_embeddings(model)
    if untie:  # the head gets its own tensor: merging its delta must leave the input embeddings alone
        for sub in (config, config.get_text_config()):
            sub.tie_word_embeddings = False
        model = _empty_model(config, lora, model_path, score_head=score_head)
    if adapter_only:
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        missing = trainable - state_dict.keys()
        if missing:
            raise ValueError(f"the state dict lacks adapter weights {sorted(missing)[:4]}: is it from this LoRA run?")
        adapter = {k: _cast(state_dict[k], dtype) for k in sorted(trainable)}
        state_dict.clear()
        model.save_pretrained(str(out), state_dict=adapter, save_embedding_layers=False)
    else:
        model.load_state_dict(state_dict, strict=True, assign=True)
        state_dict.clear()
        base = model.get_base_model() if lora is not None else model
        if untie:
            _own_head_tensors(base)
        else:
            base.tie_weights()  # assign replaced the tied parameters one by one
        if lora is not None:
            base = model.merge_and_unload()  # into the base weights, in their precision (fp32 from a checkpoint)
        if dtype is not None:
            base.to(dtype)
        base.config.dtype = base.dtype
        _copy_generation_config(base, model_path)
        base.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    if getattr(config, "vision_config", None) is not None:
        _save_image_processor(config, vision, out, model_path)
    return out


def _empty_model(config, lora: dict[str, Any] | None, model_path: str | Path, *, score_head: bool = False):
    """The model of ``config`` on the ``meta`` device (shapes only), wrapped by PEFT for ``lora``."""
    with torch.device("meta"):  # the weights come from the state dict
        model = auto_class(config, score_head=score_head).from_config(config, dtype=torch.float32)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            base_path = str(model_path) if Path(model_path).is_dir() else None
            model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS" if score_head else "CAUSAL_LM",
                                                     base_model_name_or_path=base_path, **lora))
    return model


def _is_adapted(module: torch.nn.Module) -> bool:
    """Whether PEFT wrapped ``module`` (a LoRA layer, or a trained copy: ``modules_to_save``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))


def _adapts_tied_embeddings(model) -> bool:
    """Whether the PEFT ``model`` adapts its LM head or its input embeddings while the two share one
    weight (``tie_word_embeddings``). Training then changes one and not the other (the LoRA delta, or
    the trained copy, is the head's alone), so a merged export needs the head's own tensor: merged
    into the shared one, the head's delta would land in the input embeddings too."""
    base = model.get_base_model()
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or embeddings is None or not (_is_adapted(head) or _is_adapted(embeddings)):
        return False
    shared = {id(p) for p in embeddings.parameters()}  # tied: one parameter in both modules
    return any(id(p) in shared for p in head.parameters())


def _own_head_tensors(base) -> None:
    """Gives every weight of the LM head that still shares memory with the input embeddings (the
    state dict names one tensor twice) a copy of its own, before a merge writes into it."""
    shared = {p.data_ptr() for p in base.get_input_embeddings().parameters()}
    for module in base.get_output_embeddings().modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.data_ptr() in shared:
                module._parameters[name] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


def _check_adapter(adapter_only: bool, lora: Any) -> None:
    if adapter_only and lora is None:
        raise ValueError("adapter_only: the run has no LoRA adapter (train with --lora, or save the full model)")


def _export_config(model_path: str | Path):
    """The model's config as saved: ``use_cache`` on, transformers' default attention."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model {path} does not exist; pass the run's --model (a config JSON or an HF "
                                "folder), relative to the directory the run started in, or absolute")
    config = AutoConfig.for_model(**json.loads(path.read_text())) if path.is_file() else \
        AutoConfig.from_pretrained(str(path))
    config = copy.deepcopy(config)
    for sub in (config, getattr(config, "text_config", None)):
        if sub is not None:
            sub.use_cache = True  # training turns it off: packed samples would leak through the cache
    return config


def _is_score_model(model) -> bool:
    """Whether ``model`` (no PEFT wrapper) is its family's sequence classifier: a reward model (an
    instance, not the class itself: FSDP2's ``fully_shard`` gives the root a subclass of its own)."""
    from transformers import AutoModelForSequenceClassification

    mapping = AutoModelForSequenceClassification._model_mapping
    return type(model.config) in mapping and isinstance(model, mapping[type(model.config)])


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _copy_generation_config(model, model_path: str | Path) -> None:
    """An HF folder's own generation settings (stop tokens of a chat model), where it has them."""
    path = Path(model_path)
    if path.is_dir() and (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))


def _save_image_processor(config, vision: VisionSpec | None, out: Path, model_path: str | Path) -> None:
    """The image processor the run used: the model's own (``vision``, else built again from
    ``model_path``, with its own pixel bounds), saved so ``AutoImageProcessor.from_pretrained(out)``
    gives the pixel values the model was trained on; and for a model that takes videos its video
    processor's settings as odb used them (``AutoVideoProcessor.from_pretrained(out)``, where
    torchvision is installed, samples and processes videos as the run did)."""
    vision = vision or vision_spec_for(config, model_path)
    vision.build().save_pretrained(str(out))
    if vision.video is not None:
        if vision.video.family == "qwen3" and vision.video.num_frames is not None:
            warnings.warn(f"the run sampled {vision.video.num_frames} frames per video, which transformers' Qwen3-VL "
                          "video processor cannot store (its class rate, 2 frames a second, takes over a null fps): "
                          f"the export samples at 2 frames a second; to process as the run did, call it with "
                          f"num_frames={vision.video.num_frames}, fps=None", stacklevel=2)
        settings = vision.video.processor_config()
        (out / "video_preprocessor_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def find_checkpoint(path: str | Path) -> Path:
    """The tag folder ``path`` names: itself (it holds ``run_config.json``), or the ``latest`` tag
    of ``OUTPUT_DIR/checkpoints`` or of ``OUTPUT_DIR``.

    Raises:
        FileNotFoundError: naming what to pass instead.
    """
    path = Path(path)
    fix = "pass OUTPUT_DIR/checkpoints/<tag> (a folder with run_config.json) or OUTPUT_DIR/checkpoints"
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} is not a folder; {fix}")
    if (path / "run_config.json").is_file():
        return path
    for folder in (path, path / "checkpoints"):
        if (folder / "latest").is_file():
            tag = folder / (folder / "latest").read_text().strip()
            if not (tag / "run_config.json").is_file():
                raise FileNotFoundError(f"{folder / 'latest'} names {tag.name}, but {tag} has no run_config.json; "
                                        f"{fix}")
            return tag
    if (backend := backends.for_checkpoint(path)) is not None:
        raise FileNotFoundError(f"{path} holds {backend.TITLE} files but no run_config.json (odb writes it with each "
                                f"checkpoint, rank 0); {fix}")
    raise FileNotFoundError(f"{path} is not a checkpoint (no run_config.json, no 'latest' file); {fix}")


def consolidated_state_dict(tag_folder: Path, *, run: dict[str, Any], model_path: str | Path,
                            exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """The full weights of a checkpoint, in one process, put together by the backend that saved it
    (its ``consolidated_state_dict``: DeepSpeed's ``zero_to_fp32``, FSDP2's DCP folder)."""
    backend = backends.for_checkpoint(tag_folder)
    if backend is None:
        raise FileNotFoundError(f"{tag_folder} has no checkpoint files of any backend ({', '.join(backends.NAMES)}): "
                                "the save did not finish; export another tag")
    return backend.consolidated_state_dict(tag_folder, run=run, model_path=model_path, exclude_frozen=exclude_frozen)


def export_checkpoint(checkpoint_dir: str | Path, out: str | Path, *, adapter_only: bool = False,
                      dtype: torch.dtype | str | None = None, model_path: str | Path | None = None,
                      tokenizer: str | Path | None = None) -> Path:
    """Writes a saved checkpoint as a Hugging Face folder ``out`` (one process, no process group).

    Args:
        checkpoint_dir: ``OUTPUT_DIR/checkpoints/<tag>``, or ``OUTPUT_DIR/checkpoints`` (its latest).
        out: the folder to write.
        adapter_only: LoRA: save the adapter instead of the merged model.
        dtype: of the saved weights (default: the run's precision: bf16 or fp16 if DeepSpeed's JSON
            enabled it, else fp32).
        model_path / tokenizer: instead of the run's (``run_config.json``), e.g. where they moved.

    Returns:
        ``out``.
    """
    tag_folder = find_checkpoint(checkpoint_dir)
    run = json.loads((tag_folder / "run_config.json").read_text())
    model = run["model"]
    _check_adapter(adapter_only, model["lora"])
    optimization = run["optimization"]
    dtype = _as_dtype(dtype) or backends.get(optimization.get("backend", "deepspeed")).saved_dtype(optimization)
    tokenizer = Path(tokenizer or model["tokenizer"])
    if not tokenizer.is_dir():
        raise FileNotFoundError(f"tokenizer {tokenizer} (model.tokenizer in {tag_folder / 'run_config.json'}) "
                                "does not exist here; pass --tokenizer")
    processing = run["data"]["processing"]  # the run's pixel and video settings (a run before videos: none)
    data = DataConfig(**{f.name: processing[f.name] for f in dataclasses.fields(DataConfig)
                         if f.name in processing and (f.name.endswith("_pixels") or f.name.startswith("video_"))})
    vision = vision_spec_for(_export_config(model_path or model["path"]), model_path or model["path"],
                             min_pixels=data.min_pixels, max_pixels=data.max_pixels, video=data.video_settings())
    state_dict = consolidated_state_dict(tag_folder, run=run, model_path=model_path or model["path"],
                                         exclude_frozen=adapter_only)
    return write_hf(state_dict, model_path=model_path or model["path"],
                    lora=model["lora"], tokenizer=tokenizer, out=out, adapter_only=adapter_only, dtype=dtype,
                    vision=vision, score_head=run_scores(run))
