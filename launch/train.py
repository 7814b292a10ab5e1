#!/usr/bin/env python
"""Fine-tune with odb under DeepSpeed.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/ds_zero2.json

With no flags: the bundled tiny model on the bundled chat data, one epoch (CPU ranks on gloo
where there is no GPU). ``python launch/train.py --help`` lists the flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from odb.training.cli import parse_args  # noqa: E402
from odb.training.run import Trainer  # noqa: E402


def main() -> None:
    args = parse_args()  # every input checked here, before any process group
    trainer = Trainer.init(args)
    trainer.build()
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    main()
