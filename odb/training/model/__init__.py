"""The model: building it from a Hugging Face folder or a config JSON, with LoRA
(:mod:`~odb.training.model.build`); which models odb cannot pack (:mod:`~odb.training.model.capability`);
a mixture-of-experts model's router loss (:mod:`~odb.training.model.moe`); the M-RoPE positions of
packed multimodal rows (:mod:`~odb.training.model.mrope`)."""

from odb.imports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "build": ("PEAK_FLOPS", "Construction", "build_model", "flops_model", "hf_model", "load_tokenizer", "vision_spec"),
})
