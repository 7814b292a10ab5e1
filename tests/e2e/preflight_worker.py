"""One rank of tests/e2e/test_preflight_launch.py's DeepSpeed state check (tests/launch.py).

Usage: RANK=0 WORLD_SIZE=1 ... python tests/e2e/preflight_worker.py OUT_JSON STAGE

A tiny model under DeepSpeed at ZeRO STAGE with torch's AdamW: odb's probe step inside
``DeepSpeedBackend.pristine()`` (as the preflight runs it), then one real step of
:meth:`OdbEngine.train_step`. ZeRO-1/2 link each parameter to its optimizer state at their first
step (``_hp_mapping.optim_fragment``: views of ``exp_avg`` and ``exp_avg_sq``, which DeepSpeed's
``safe_get_full_optimizer_state`` and its checkpoints read): after the real step every link must
view the state AdamW made then, not the probe's. Writes, per parameter, whether its links view
live state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's odb, installed or not
sys.path.insert(0, str(ROOT / "tests"))

from conftest import one_step_plan  # noqa: E402
from odb.training.backends.deepspeed import DeepSpeedBackend, initialize_deepspeed, release  # noqa: E402
from odb.training.config.optimization import OptimizationSettings  # noqa: E402
from odb.training.model.build import build_model  # noqa: E402
from odb.training.run.teardown import end_process  # noqa: E402
from odb.training.step.engine import OdbEngine  # noqa: E402


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 1.0, "bf16": {"enabled": False}, "zero_optimization": {"stage": stage},
                 "steps_per_print": 10**6}
    model = build_model(ROOT / "configs" / "tiny_model.json", seed=0, vocab_size=1024)
    backend = DeepSpeedBackend(initialize_deepspeed(OptimizationSettings(lr=1e-3, deepspeed=ds_config), model))
    engine = OdbEngine(backend, world_size=1, max_tokens=256, pad_token_id=0)
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(1024, (n,), generator=generator)} for n in (60, 90)]
    with backend.pristine():
        engine.probe_step([{"input_ids": torch.randint(1024, (256,), generator=generator)}])
    engine.train_step(one_step_plan([samples]), [samples], 1e-3)
    live = {t.untyped_storage().data_ptr() for state in backend.engine.optimizer.optimizer.state.values()
            for t in state.values() if isinstance(t, torch.Tensor)}
    links = {}
    for name, param in model.named_parameters():
        fragment = getattr(getattr(param, "_hp_mapping", None), "optim_fragment", None) or {}
        links[name] = {key: view.untyped_storage().data_ptr() in live for key, view in fragment.items()}
    out.write_text(json.dumps({"linked": links, "stage": stage}))
    release()
    end_process(0)


if __name__ == "__main__":
    main()
