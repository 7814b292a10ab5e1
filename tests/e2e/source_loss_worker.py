"""One rank of tests/e2e/test_source_loss_launch.py: launch/train.py's own run (the same flags, the
same :func:`odb.training.main.main`), its training and eval data a mixture of named sources
(:class:`odb.data.mixture.MixedDataset`) built here, until odb's data flags name several sources.

Usage (each rank with its launcher's environment): ``ODB_TEST_MIXTURE=SPEC.json python
tests/e2e/source_loss_worker.py [launch/train.py flags]``; SPEC: ``{"train": [[name, path], ...],
"eval": [[name, path], ...]}``. The flags' ``--data`` and ``--eval_data`` must name files (checked
before the run) but are not read: the run's data is the spec's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's odb, installed or not

from odb.data.mixture import MixedDataset  # noqa: E402
from odb.data.processing import SampleDataset  # noqa: E402
from odb.training import build  # noqa: E402
from odb.training.cli import FileDefaults  # noqa: E402
from odb.training.main import main  # noqa: E402


def mixed_datasets(config, tokenizer, vision, *, truncate_to):
    """:func:`odb.training.build._datasets` over the spec's sources: training data cut to the cap,
    eval data whole and without augmentation, as the trainer builds them."""
    spec = json.loads(Path(os.environ["ODB_TEST_MIXTURE"]).read_text())
    common = {"seed": config.seed, "vision": vision}
    plain = dataclasses.replace(config.data.processing, system_prompt_prob=0.0, turn_sampling=False)
    train = MixedDataset([(name, SampleDataset(path, tokenizer, config.data.processing, truncate_to=truncate_to,
                                               **common)) for name, path in spec["train"]])
    held = MixedDataset([(name, SampleDataset(path, tokenizer, plain, **common)) for name, path in spec["eval"]]) \
        if spec.get("eval") else None
    return train, held


if __name__ == "__main__":
    build._datasets = mixed_datasets
    main(defaults=FileDefaults.bundled(ROOT))
