"""One rank of tests/e2e/test_evaluate.py, one process per rank (tests/launch.py, or by hand under torchrun).

Usage: torchrun --nproc_per_node W tests/e2e/eval_worker.py SCENARIO.json

The scenario: ``model`` (a config JSON), ``tokenizer`` (optional: a folder; default the bundled
one), ``data``, ``max_samples``, ``image_folder`` (or null), ``data_config`` (optional: more
:class:`DataConfig` fields),
``evals`` (each ``{"name", "batching": odb settings over configs/odb.json, "num_workers"}``),
``train_lr`` (or null) and ``out``. The rank builds the model (seed 0) under ZeRO-3, builds a
training batcher, runs every eval in order through :class:`odb.training.run.evaluate.Evaluator`; with
``train_lr`` it then trains one SGD step and evaluates the first eval's settings once more
(``after_train``), and rank 0 saves the gathered weights (``weights.pt``) for the oracle. Each
rank writes ``rank<R>.json``: every result, and what its :class:`RecordingEngine` saw.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import deepspeed
import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's odb, installed or not

from odb.batching.align import TorchCommunicator  # noqa: E402
from odb.batching.batcher import OnlineBatcher  # noqa: E402
from odb.batching.config import OdbConfig  # noqa: E402
from odb.data.feed import SampleFeed  # noqa: E402
from odb.data.processing import DataConfig, SampleDataset, sample_sizes  # noqa: E402
from odb.training.backends.deepspeed import DeepSpeedBackend, release  # noqa: E402
from odb.training.model.build import build_model, load_tokenizer, vision_spec  # noqa: E402
from odb.training.run.evaluate import Evaluator  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import BLANK_IMAGE_TOKENS, OdbEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class RecordingEngine(OdbEngine):
    """The engine, noting what every eval step ran: micro-batch sizes, sample indices, each forward
    of the model (in train mode? gradients on?) and the DataLoader workers alive."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []

    def eval_step(self, plan, samples, **options):
        forwards: list[tuple[bool, bool]] = []
        hook = self.backend.module.register_forward_pre_hook(
            lambda module, args: forwards.append((module.training, torch.is_grad_enabled())))
        try:
            result = super().eval_step(plan, samples, **options)
        finally:
            hook.remove()
        self.seen.append({"sizes": [len(m.samples) for m in plan.micro_batches],
                          "ids": [int(s["index"]) for micro in samples for s in micro], "forwards": forwards,
                          "children": len(psutil.Process().children(recursive=True))})
        return result


def deepspeed_engine(model, world: int):
    config = json.loads((ROOT / "configs" / "ds_zero3.json").read_text())
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world,
                  bf16={"enabled": False}, gradient_clipping=0.0, zero_allow_untested_optimizer=True)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                      optimizer=torch.optim.SGD(params, lr=0.0))
    return engine


def run(scenario: dict, rank: int, world: int) -> dict:
    tokenizer = load_tokenizer(scenario.get("tokenizer") or ROOT / "data" / "tokenizer")
    model = build_model(scenario["model"], seed=0, vocab_size=len(tokenizer))
    data_config = DataConfig(image_folder=scenario.get("image_folder"), **scenario.get("data_config", {}))
    vision = vision_spec(model, data_config)
    engine = deepspeed_engine(model, world)
    comm = TorchCommunicator(timeout_s=120)
    base = json.loads((ROOT / "configs" / "odb.json").read_text())

    def settings(values: dict) -> OdbConfig:
        batching = OdbConfig(**{**base, **values})
        if vision is not None:  # room for the blank image of an imageless micro-batch, as the trainer keeps
            batching = dataclasses.replace(batching, max_tokens=batching.max_tokens - BLANK_IMAGE_TOKENS)
        return batching

    def dataset(batching: OdbConfig | None) -> SampleDataset:
        """Training data cut to the batching's cap; eval data (``None``) whole, as the trainer builds it."""
        return SampleDataset(scenario["data"], tokenizer, data_config, max_samples=scenario["max_samples"],
                             truncate_to=batching.max_tokens if batching is not None else None, vision=vision)

    def evaluate(spec: dict) -> dict:
        batching = settings(spec["batching"])
        recording = RecordingEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=batching.max_tokens,
                                    pad_token_id=tokenizer.pad_token_id)
        result = Evaluator(recording, dataset(None), batching, comm, num_workers=spec.get("num_workers", 0)).run()
        return {"name": spec["name"], "num_workers": spec.get("num_workers", 0),
                "result": dataclasses.asdict(result), "steps": recording.seen,
                "training_after": engine.module.training,
                "children_after": len(psutil.Process().children(recursive=True))}

    # the training batcher exists first (its settings check is a collective on the same communicator)
    train_batching = settings({"max_tokens": 512, "window": 8})
    train_feed = SampleFeed(dataset(train_batching), sample_sizes)
    batcher = OnlineBatcher(train_batching, comm, dataset_size=len(train_feed.dataset), feed=train_feed)
    out: dict = {"rank": rank, "world": world, "evals": [evaluate(spec) for spec in scenario["evals"]]}
    if scenario.get("train_lr"):
        trainer = OdbEngine(DeepSpeedBackend(engine), world_size=world, max_tokens=train_batching.max_tokens,
                            pad_token_id=tokenizer.pad_token_id)
        plan = next(iter(batcher))
        trainer.train_step(plan, [[train_feed.take(u) for u in m.uids] for m in plan.micro_batches],
                           scenario["train_lr"])
        out["evals"].append(evaluate({**scenario["evals"][0], "name": "after_train"}))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            if rank == 0:
                weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
                torch.save(weights, Path(scenario["out"]) / "weights.pt")
    train_feed.close()
    return out


def main() -> None:
    scenario = json.loads(Path(sys.argv[-1]).read_text())  # (DeepSpeed's runner puts --local_rank first)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    deepspeed.init_distributed(timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    try:
        out = run(scenario, rank, world)
        (Path(scenario["out"]) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
        release()


if __name__ == "__main__":
    main()
    end_process(0)  # as launch/train.py ends: no C++ destructors of torch's threads at exit
