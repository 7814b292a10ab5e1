"""The model and tokenizer: a local Hugging Face folder, or a config JSON for a random-init model;
optional PEFT LoRA and activation (gradient) checkpointing; odb's varlen attention registered and
selected.

How a backend constructs it is the backend's (:class:`Construction`): DeepSpeed's ZeRO-3 partitions
it while it is built (:mod:`odb.training.backends.deepspeed`), FSDP2 builds it on ``meta`` and
fills the shards from rank 0 (:mod:`odb.training.backends.fsdp2`).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch

from odb.data.images import VisionSpec, vision_spec_for
from odb.telemetry.flops import FlopsModel
from odb.training.attention.varlen import register

__all__ = ["Construction", "PEAK_FLOPS", "auto_class", "build_model", "flops_model", "hf_model", "load_tokenizer",
           "vision_spec"]


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


class Construction(Protocol):
    """How a backend has the model constructed: DeepSpeed's ZeRO-3 partitions it while it is built
    (:func:`odb.training.backends.deepspeed.build_model`)."""

    def random_init(self) -> AbstractContextManager[None]:
        """Around ``from_config`` (a random init)."""

    def pretrained(self) -> AbstractContextManager[None]:
        """Around ``from_pretrained`` and PEFT's ``get_peft_model``."""


def build_model(path: str | Path, *, seed: int, vocab_size: int, lora: Mapping[str, Any] | None = None,
                gradient_checkpointing: bool = False, empty: bool = False, dtype: torch.dtype | str | None = None,
                construction: Construction | None = None, score_head: bool = False):
    """A causal LM with ``attn_implementation="odb_varlen"``, in train mode, ``use_cache`` off
    (``score_head``: a reward model, :func:`auto_class`).

    Args:
        path: a Hugging Face model folder, or a model config JSON (random init from ``seed``).
        seed: seeds torch before the model is built: the random init and LoRA's init.
        vocab_size: the tokenizer's; the model must have at least as many embeddings.
        lora: PEFT ``LoraConfig`` fields, or None to train every weight.
        gradient_checkpointing: recompute each layer's activations in the backward pass
            (non-reentrant ``torch.utils.checkpoint``; the vision tower's blocks too).
        empty: shapes only: every parameter (LoRA's too) on the ``meta`` device, no weights read
            (a folder's config only); buffers, such as rotary frequencies, real. For FSDP2, which
            fills the shards from rank 0 (:mod:`odb.training.backends.fsdp2`).
        dtype: the precision (default fp32); ``"auto"``: a folder's own.
        construction: the backend's way to construct it (collective where the backend's is: every
            rank, after the process group is joined); None: whole, in this process.
        score_head: the language model under a one-output score head instead of its LM head
            (``AutoModelForSequenceClassification``, ``num_labels`` 1: a Bradley-Terry reward model,
            :mod:`odb.training.step.reward`); the head is a new, seeded init, as TRL's reward models
            start; LoRA trains it whole (PEFT's ``SEQ_CLS`` task keeps the score head trainable).
    """
    from transformers import AutoConfig

    attn = register()
    path = Path(path)
    config = AutoConfig.for_model(**json.loads(path.read_text())) if path.is_file() else \
        AutoConfig.from_pretrained(str(path))
    text_config = getattr(config, "text_config", config)
    if score_head:
        config.num_labels = 1
    if text_config.vocab_size < vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
                         f"{text_config.vocab_size}; use the model's own tokenizer (--tokenizer)")
    dtype = dtype or torch.float32
    torch.manual_seed(seed)  # the same random init, and the same LoRA init, on every rank
    with _parameters_on_meta() if empty else nullcontext():
        with _freed_memory_returned() if construction is not None else nullcontext():
            model = _construct(path, config, attn=attn, construction=construction, dtype=dtype, empty=empty,
                               score_head=score_head)
        model.config.use_cache = False  # packed samples leak into each other through the cache
        model.train()  # from_pretrained leaves a model in eval mode: dropout off
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            # (under ZeRO-3 PEFT gathers where an init reads the weight)
            with construction.pretrained() if construction else nullcontext():
                model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS" if score_head else "CAUSAL_LM", **lora))
    if gradient_checkpointing:
        _checkpoint_activations(model.get_base_model() if lora is not None else model)
    return model


def auto_class(config, *, score_head: bool = False):
    """The transformers auto class of a model of ``config``: an image-text model's own (Qwen2-VL,
    Qwen3-VL, ...), a causal LM, or with ``score_head`` a sequence classifier (a reward model: text
    models only, refused here naming the fix)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    vision = getattr(config, "vision_config", None) is not None
    if score_head:
        if vision or type(config) not in AutoModelForSequenceClassification._model_mapping:
            raise ValueError(f"--objective reward trains a score head on the language model "
                             f"(AutoModelForSequenceClassification), which transformers has no class for with "
                             f"{config.model_type}{' (a vision-language model)' if vision else ''}: train a text model "
                             "of a family that has one (Llama, Qwen2, Qwen3, Gemma, Mistral, ...)")
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def _construct(path: Path, config, *, attn: str, construction: Construction | None, dtype: torch.dtype | str,
               empty: bool = False, score_head: bool = False):
    """The model in ``dtype``: a random init (``path`` a config JSON, or ``empty``: from the config
    alone, the weights never read) or a folder's weights, constructed the backend's way."""
    auto = auto_class(config, score_head=score_head)
    construction = None if empty else construction
    if empty or path.is_file():
        dtype = torch.float32 if dtype == "auto" else dtype
        with construction.random_init() if construction else nullcontext():
            return auto.from_config(config, attn_implementation=attn, dtype=dtype)
    with construction.pretrained() if construction else nullcontext():
        return auto.from_pretrained(str(path), config=config, attn_implementation=attn, dtype=dtype)


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


def vision_spec(model, data_config, source: str | Path | None = None) -> VisionSpec | None:
    """The model's own image processor and the geometry odb counts with (None for a text model):
    :func:`odb.data.images.vision_spec_for`, with the data config's pixel bounds.

    Args:
        model: the model (PEFT-wrapped or not).
        data_config: its ``min_pixels`` / ``max_pixels`` and video settings (None: the model's own).
        source: the run's ``--model`` (a folder: its preprocessor_config.json; a config JSON: the
            family's processor). Default: the folder the model was loaded from, where it was. Pass
            it in a run: a rank that builds the model from its config alone does not know the folder.
    """
    config = hf_model(model).config
    if source is None:
        loaded_from = getattr(config, "_name_or_path", "") or ""
        source = loaded_from if loaded_from and Path(loaded_from).is_dir() else None
    return vision_spec_for(config, source, min_pixels=data_config.min_pixels, max_pixels=data_config.max_pixels,
                           video=data_config.video_settings())


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
              "B200": 2250e12, "L40S": 362e12}
"""Dense bf16/fp16 FLOP/s of one device by the vendor's datasheet (SXM parts), by a part of its name."""


def flops_model(model, device: torch.device, dtype: torch.dtype) -> FlopsModel:
    """What the rows' ``mfu`` needs (:class:`odb.telemetry.flops.FlopsModel`): the parameters a
    token meets in a matmul (every weight matrix but the input embedding's and a vision tower's; a head
    tied to the embedding counts once, as the head; a mixture-of-experts model counts every expert,
    so its MFU is overstated by its share of inactive experts), the language model's layers and
    attention width (heads x head dim; sliding windows not taken off), and the device's peak where
    odb knows it (a GPU of :data:`PEAK_FLOPS` in bf16 or fp16; the SXM figure: a PCIe part's MFU is
    understated)."""
    hf = hf_model(model)
    text = getattr(hf.config, "text_config", None) or hf.config
    numel = lambda p: int(getattr(p, "ds_numel", 0) or p.numel())  # noqa: E731 (ZeRO-3 partitions p)
    embedding = hf.get_input_embeddings().weight
    vision = getattr(getattr(hf, "model", None), "visual", None)
    skipped = {id(p) for p in vision.parameters()} if vision is not None else set()
    matrix = lambda p: len(getattr(p, "ds_shape", None) or p.shape) >= 2  # noqa: E731 (norms, biases: no matmul)
    matmul = sum(numel(p) for p in hf.parameters() if id(p) not in skipped and p is not embedding and matrix(p))
    head = hf.get_output_embeddings()
    if head is not None and head.weight is embedding:
        matmul += numel(embedding)
    peak = None
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        peak = next((flops for part, flops in PEAK_FLOPS.items() if part in name), None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    width = heads * head_dim if heads and head_dim else text.hidden_size  # (Qwen3, Gemma: not hidden_size)
    return FlopsModel(matmul_params=matmul, layers=text.num_hidden_layers, hidden=width, peak_flops=peak)
