"""One rank of a real multi-process run on gloo, started by torchrun from test_gloo.py.

Usage: torchrun --nproc_per_node W tests/gloo_worker.py OUT_DIR SCENARIO_JSON
Writes OUT_DIR/rank<R>.json with the rank's steps (or the error it raised).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from odb.batching.align import TorchCommunicator  # noqa: E402
from odb.batching.batcher import OnlineBatcher  # noqa: E402
from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.simulate import SimulatedFeed  # noqa: E402
from odb.batching.state import encode_steps  # noqa: E402


def main() -> None:
    out_dir, scenario = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "world": world}
    if "gather" in scenario:  # the collective alone: rank r sends lengths[r] values r * 1000 + i
        comm = TorchCommunicator(timeout_s=60)
        mine = [rank * 1000 + i for i in range(scenario["gather"][rank])]
        rows, lengths = comm.all_gather_v(np.array(mine, dtype=np.int64))
        result.update(rows=rows.tolist(), lengths=lengths.tolist(),
                      matrix=comm.all_gather(np.array([rank, -rank], dtype=np.int64)).tolist())
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        return
    config = OdbConfig(**{**scenario["config"], **scenario.get("per_rank", {}).get(str(rank), {})})
    lengths = [(t, 0) for t in scenario["lengths"]]
    try:
        comm = TorchCommunicator(timeout_s=60)
        batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=SimulatedFeed(lengths),
                                num_epochs=scenario.get("epochs", 1), shards=scenario.get("shards"))
        result["steps"] = encode_steps(list(batcher))
        result["rounds"] = batcher.round_index
        result["collectives"] = comm.num_collectives
    except ValueError as err:
        result["error"] = f"{type(err).__name__}: {err}"
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
