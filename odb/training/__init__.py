"""transformers + DeepSpeed / FSDP2: odb's training side, over :mod:`odb.batching` and :mod:`odb.data`.

Folders, each using only those above it (``tests/unit/test_layers.py`` checks the order):

    config/      the run's settings as frozen dataclasses, LoRA's checks, a rank's environment
    attention/   odb_varlen: packed varlen attention with each model's own semantics (CPU, CUDA)
    model/       the model and tokenizer, what odb can pack, MoE router loss, M-RoPE positions
    backends/    DeepSpeed and FSDP2, each owning its whole life; joining the process group
    step/        one optimizer step: the engine's model calls, the objective (the loss math),
                 the chunked loss, per-source sums, sequence parallelism
    run/         the run: assembly, the loop, checkpoints, evaluation, schedule, preflight and
                 budget, start-up checks, announced waits, watchdog, stop on request, teardown
    launch/      ``launch/train.py``'s flags, the output folder's policy, one rank's main
    export.py    a Hugging Face model folder from a run or a checkpoint (``odb export``)
    check_model.py, check_media.py   odb's path against the model's own (``odb check-model``)

Reading order for a newcomer: ``launch/main.py`` -> ``run/loop.py`` -> ``step/engine.py`` and
``step/objective.py``; :mod:`odb.training.run.assemble` shows how the parts fit together.
"""
