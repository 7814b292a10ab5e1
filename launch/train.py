#!/usr/bin/env python
"""Fine-tune with odb under DeepSpeed (the default) or FSDP2.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/ds_zero2.json
    torchrun --nproc_per_node 2 launch/train.py --backend fsdp2 --fsdp_config configs/fsdp2.json
    deepspeed --num_gpus 2 launch/train.py --recipe configs/recipes/demo.yaml --max_samples 100

With no flags: the bundled tiny model on the bundled chat data, one epoch (CPU ranks on gloo
where there is no GPU). ``python launch/train.py --help`` lists the flags; ``odb train RECIPE``
(an installed odb's command) starts the same run from a recipe. The run itself:
:func:`odb.training.launch.main.main`.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from odb.training.launch.flags import FileDefaults  # noqa: E402
from odb.training.launch.main import main  # noqa: E402

DEFAULTS = FileDefaults.bundled(REPO)

if __name__ == "__main__":
    main(defaults=DEFAULTS)
