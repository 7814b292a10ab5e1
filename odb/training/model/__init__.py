"""The model: building it from a Hugging Face folder or a config JSON, with LoRA
(:mod:`~odb.training.model.build`); which models odb cannot pack (:mod:`~odb.training.model.capability`);
a mixture-of-experts model's router loss (:mod:`~odb.training.model.moe`); the M-RoPE positions of
packed multimodal rows (:mod:`~odb.training.model.mrope`)."""
