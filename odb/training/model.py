"""The model and tokenizer: a local Hugging Face folder, or a config JSON for a random-init model;
optional PEFT LoRA and activation (gradient) checkpointing; odb's varlen attention registered and
selected.

The model is built in DeepSpeed's training precision (:func:`training_dtype`) and, at ZeRO-3,
partitioned while it is constructed (``deepspeed.zero.Init``): a rank holds its partition and, for
a moment, one module whole, never the whole model. A folder loads through transformers' DeepSpeed
integration (rank 0 memory-maps the checkpoint and fills each module's parameters, gathered, then
partitioned again; the other ranks read only the shapes); a random init draws exactly the numbers
a plain ``from_config`` draws (:func:`_zero3_random_init`), so a seed gives the same weights at
every ZeRO stage and on one process.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from odb.data.images import VisionSpec, vision_spec_for
from odb.training.attention import register

__all__ = ["build_model", "hf_model", "is_zero3", "load_tokenizer", "training_dtype", "vision_spec"]


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {path} has no chat template; odb formats samples with "
                         "apply_chat_template (set tokenizer.chat_template and save it)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def hf_model(model):
    """The Hugging Face model inside a PEFT wrapper, or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def training_dtype(ds_config: Mapping[str, Any] | None) -> torch.dtype:
    """DeepSpeed's training precision: bf16 or fp16 where its (resolved) JSON enables one, else fp32."""
    if ds_config is not None:
        for keys, dtype in ((("bf16", "bfloat16"), torch.bfloat16), (("fp16",), torch.float16)):
            if any((ds_config.get(key) or {}).get("enabled") is True for key in keys):
                return dtype
    return torch.float32


def is_zero3(ds_config: Mapping[str, Any] | None) -> bool:
    return ds_config is not None and (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3


def build_model(path: str | Path, *, seed: int, vocab_size: int, lora: Mapping[str, Any] | None = None,
                ds_config: Mapping[str, Any] | None = None, gradient_checkpointing: bool = False,
                empty: bool = False, dtype: torch.dtype | str | None = None):
    """A causal LM with ``attn_implementation="odb_varlen"``, in train mode, ``use_cache`` off.

    Args:
        path: a Hugging Face model folder, or a model config JSON (random init from ``seed``).
        seed: seeds torch before the model is built: the random init and LoRA's init.
        vocab_size: the tokenizer's; the model must have at least as many embeddings.
        lora: PEFT ``LoraConfig`` fields, or None to train every weight.
        ds_config: DeepSpeed's resolved JSON: the model is built in its precision and, at ZeRO-3,
            partitioned as it is constructed (collective: every rank calls this, after the process
            group is joined). None: fp32, whole (a one-process model).
        gradient_checkpointing: recompute each layer's activations in the backward pass
            (non-reentrant ``torch.utils.checkpoint``; the vision tower's blocks too).
        empty: shapes only: every parameter (LoRA's too) on the ``meta`` device, no weights read
            (a folder's config only); buffers, such as rotary frequencies, real. For FSDP2, which
            fills the shards from rank 0 (:mod:`odb.training.fsdp2`).
        dtype: the precision instead of DeepSpeed's; ``"auto"``: a folder's own.
    """
    from transformers import AutoConfig

    attn = register()
    path = Path(path)
    config = AutoConfig.for_model(**json.loads(path.read_text())) if path.is_file() else \
        AutoConfig.from_pretrained(str(path))
    text_config = getattr(config, "text_config", config)
    if text_config.vocab_size < vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
                         f"{text_config.vocab_size}; use the model's own tokenizer (--tokenizer)")
    zero3 = is_zero3(ds_config)
    dtype = dtype or training_dtype(ds_config)
    torch.manual_seed(seed)  # the same random init, and the same LoRA init, on every rank
    with _parameters_on_meta() if empty else nullcontext():
        with _freed_memory_returned() if zero3 else nullcontext():
            model = _construct(path, config, attn=attn, ds_config=ds_config, dtype=dtype, empty=empty)
        model.config.use_cache = False  # packed samples leak into each other through the cache
        model.train()  # from_pretrained leaves a model in eval mode: dropout off
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            with _hf_zero3(ds_config) if zero3 else nullcontext():  # (PEFT gathers where an init reads the weight)
                model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    if gradient_checkpointing:
        _checkpoint_activations(model.get_base_model() if lora is not None else model)
    return model


def _auto_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # Image-text models (Qwen2-VL, Qwen3-VL, ...) load through their own auto class.
    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


def _construct(path: Path, config, *, attn: str, ds_config: Mapping[str, Any] | None, dtype: torch.dtype | str,
               empty: bool = False):
    """The model in ``dtype``: a random init (``path`` a config JSON, or ``empty``: from the config
    alone, the weights never read) or a folder's weights; at ZeRO-3 partitioned as it is constructed."""
    auto, zero3 = _auto_class(config), is_zero3(ds_config) and not empty
    if empty or path.is_file():  # (not transformers' own ZeRO-3 path: it would draw other numbers)
        dtype = torch.float32 if dtype == "auto" else dtype
        with _zero3_random_init(ds_config) if zero3 else nullcontext():
            return auto.from_config(config, attn_implementation=attn, dtype=dtype)
    # at ZeRO-3 transformers builds it under zero.Init, then fills each parameter gathered, from rank 0
    with _hf_zero3(ds_config) if zero3 else nullcontext():
        return auto.from_pretrained(str(path), attn_implementation=attn, dtype=dtype)


def _checkpoint_activations(model) -> None:
    """Every decoder layer and vision block recomputed in the backward pass, non-reentrant: the
    layer's keyword arguments (odb's ``cu_seq_lens_*``, ``position_ids``) pass through as they are,
    and gradients reach the weights inside (LoRA's too) whether or not the layer's input requires
    grad. So the hooks transformers adds to make the input embeddings' output require grad (which
    reentrant checkpoints need) come off again: with LoRA they would run the backward, and the
    recomputation, through a frozen vision tower and the frozen embeddings for nothing."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters created inside go to the ``meta`` device (as they are registered); buffers stay real."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@contextmanager
def _freed_memory_returned() -> Iterator[None]:
    """glibc keeps freed heap memory for reuse, and a partitioned build frees a lot: each module is
    made whole, then cut to this rank's partition. Kept, that memory counts in the rank's resident
    set as if the model were whole (measured on 2 CPU ranks: a higher peak than a full load). While
    the model is built, large blocks are mapped and go back to the system when freed; after it,
    free heap is returned. No-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    m_mmap_threshold = -3  # mallopt's M_MMAP_THRESHOLD
    libc.mallopt(m_mmap_threshold, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(m_mmap_threshold, 128 * 1024)  # glibc's default
        libc.malloc_trim(0)


@contextmanager
def _hf_zero3(ds_config: Mapping[str, Any]) -> Iterator[None]:
    """transformers' and PEFT's ZeRO-3 code paths on (``is_deepspeed_zero3_enabled()``), while the
    model is built only: transformers looks the config up through a weak reference to this object."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    held = HfDeepSpeedConfig(dict(ds_config))
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del held


@contextmanager
def _zero3_random_init(ds_config: Mapping[str, Any]) -> Iterator[None]:
    """``from_config`` under ``deepspeed.zero.Init``, drawing the numbers a plain ``from_config`` draws.

    A plain build interleaves two inits, in this order: torch's default init of each module as it is
    constructed, and transformers' ``initialize_weights`` at the end of each sub-model's constructor
    (children first). ``zero.Init`` runs the first on each module's whole tensors before it
    partitions them; transformers' own ZeRO-3 path skips both and re-initializes afterwards, which
    draws other numbers. Here ``PreTrainedModel.initialize_weights`` is replaced, while the model is
    constructed, by one that gathers each module's parameters while it initializes them, on every
    rank (the same numbers drawn everywhere, rank 0's kept): the random stream is the plain build's,
    one module whole at a time. (No causal LM of transformers 5.24 overrides ``initialize_weights``.)
    """
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    plain = PreTrainedModel.initialize_weights
    PreTrainedModel.initialize_weights = _initialize_weights_gathered
    try:
        with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=dict(ds_config)):
            yield
    finally:
        PreTrainedModel.initialize_weights = plain


@torch.no_grad()
def _initialize_weights_gathered(model) -> None:
    """``PreTrainedModel.initialize_weights`` on ZeRO-3 partitions: each module's ``_initialize_weights``
    (a sub-model's own for its modules), children first, with the module's parameters and those of
    its plain children gathered (transformers' ``initialize_weights_zero3``, but on every rank)."""
    import deepspeed
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    custom = model.is_custom_code()

    def visit(module: torch.nn.Module, init) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        if getattr(module, "_is_hf_initialized", False):
            return  # done by a sub-model's own constructor: ``_initialize_weights`` would skip it
        plain_children = [c for c in module.children() if not isinstance(c, PreTrainedModel)]
        params = [*module.parameters(recurse=False), *(p for c in plain_children for p in c.parameters(recurse=False))]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            init(module, custom)

    with guard_torch_init_functions():
        visit(model, model._initialize_weights)


def vision_spec(model, data_config, source: str | Path | None = None) -> VisionSpec | None:
    """The model's own image processor and the geometry odb counts with (None for a text model):
    :func:`odb.data.images.vision_spec_for`, with the data config's pixel bounds.

    Args:
        model: the model (PEFT-wrapped or not).
        data_config: its ``min_pixels`` / ``max_pixels`` (None: the model's own).
        source: the run's ``--model`` (a folder: its preprocessor_config.json; a config JSON: the
            family's processor). Default: the folder the model was loaded from, where it was. Pass
            it in a run: a rank that builds the model from its config alone does not know the folder.
    """
    config = hf_model(model).config
    if source is None:
        loaded_from = getattr(config, "_name_or_path", "") or ""
        source = loaded_from if loaded_from and Path(loaded_from).is_dir() else None
    return vision_spec_for(config, source, min_pixels=data_config.min_pixels, max_pixels=data_config.max_pixels)
