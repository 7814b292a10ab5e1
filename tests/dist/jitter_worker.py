"""One rank of a jittered multi-process run on gloo, started by torchrun from test_gloo_jitter.py.

Usage: torchrun --nproc_per_node W tests/dist/jitter_worker.py OUT_DIR SCENARIO_JSON
Writes OUT_DIR/rank<R>.json with the rank's steps, its round and collective counts, the time it
waited in collectives and its sleeps (``time.monotonic`` spans, comparable across processes).

Delays, each ``uniform(0, base) x slowness[rank]`` from a generator seeded by (seed, rank):
before every fetch (the batcher waiting for processed samples), after every step (its forward and
backward), and with ``"feed": "loader"`` also in the DataLoader workers, per sample (seeded by
uid), behind odb's real :class:`~odb.data.feed.SampleFeed`. With the loader feed each step takes
its samples out of the feed, as training does, and checks that they are the planned ones (and, in
join mode, that no fetched sample is left behind at the end).
"""

import json
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from odb.batching.align import TorchCommunicator  # noqa: E402
from odb.batching.batcher import OnlineBatcher  # noqa: E402
from odb.batching.config import OdbConfig  # noqa: E402
from odb.batching.simulate import SimulatedFeed  # noqa: E402
from odb.batching.state import encode_steps  # noqa: E402
from odb.data.feed import SampleFeed  # noqa: E402


class Jitter:
    def __init__(self, seed: int, rank: int, slowness: float) -> None:
        self.rng, self.slowness = random.Random(f"{seed}/{rank}"), slowness
        self.sleeps: list[tuple[float, float]] = []

    def sleep(self, base_s: float) -> None:
        start = time.monotonic()
        time.sleep(self.rng.uniform(0.0, base_s) * self.slowness)
        self.sleeps.append((start, time.monotonic()))


class JitteryFeed:
    """Sleeps before each fetch, then hands over to the wrapped feed (deal, fetch, forget)."""

    def __init__(self, inner, jitter: Jitter, delay_s: float) -> None:
        self.inner, self.jitter, self.delay_s = inner, jitter, delay_s

    def deal(self, uids: list[int]) -> None:
        self.inner.deal(uids)

    def fetch(self, uids: list[int]) -> list[tuple[int, int, int] | None]:
        self.jitter.sleep(self.delay_s)
        return self.inner.fetch(uids)

    def forget(self, uids: list[int]) -> None:
        self.inner.forget(uids)


class SlowRecords(Dataset):
    """Records as SimulatedFeed describes them (``tokens - 1`` label tokens; ``None``: skipped),
    each processed after a random delay seeded by its uid (DataLoader workers that stall)."""

    def __init__(self, lengths: list, seed: int, rank: int, slowness: float, delay_s: float) -> None:
        self.lengths, self.seed, self.rank = lengths, seed, rank
        self.slowness, self.delay_s = slowness, delay_s

    def __getitem__(self, uid: int) -> dict:
        time.sleep(random.Random(f"{self.seed}/{self.rank}/{uid}").uniform(0.0, self.delay_s) * self.slowness)
        entry = self.lengths[uid % len(self.lengths)]
        if entry is None:
            return {"uid": uid, "skip": "empty", "fatal": False, "where": f"record {uid}", "detail": "empty"}
        return {"uid": uid, "tokens": entry[0], "label_tokens": max(0, entry[0] - 1), "patches": entry[1]}


def main() -> None:
    out_dir, scenario = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    config = OdbConfig(**scenario["config"])
    lengths = [None if x is None else tuple(x) for x in scenario["lengths"]]
    seed, slowness = scenario["seed"], scenario["slowness"][rank]
    delays = scenario["delays_s"]  # {"fetch", "step", "record"}
    jitter = Jitter(seed, rank, slowness)
    if scenario["feed"] == "loader":
        records = SlowRecords(lengths, seed, rank, slowness, delays["record"])
        inner = SampleFeed(records, lambda s: (s["tokens"], s["label_tokens"], s["patches"]), num_workers=2)
    else:
        inner = SimulatedFeed(lengths)
    comm = TorchCommunicator(timeout_s=60)
    batcher = OnlineBatcher(config, comm, dataset_size=len(lengths), feed=JitteryFeed(inner, jitter, delays["fetch"]),
                            num_epochs=scenario["epochs"])
    steps = []
    for step in batcher:
        steps.append(step)
        if scenario["feed"] == "loader":
            for uid in (u for m in step.micro_batches for u in m.uids):
                assert inner.take(uid)["uid"] == uid, f"rank {rank}: the feed holds another sample for {uid}"
        jitter.sleep(delays["step"])
    if scenario["feed"] == "loader":
        # join mode trains (or forgets) every fetched sample; quota mode leaves its window behind
        assert config.mode == "quota" or not inner.store, f"rank {rank}: samples fetched but never trained: {sorted(inner.store)[:10]}"
        inner.close()
    result = {"rank": rank, "world": world, "steps": encode_steps(steps), "rounds": batcher.round_index,
              "collectives": comm.num_collectives, "collective_s": batcher.aligner.collective_s,
              "sleeps": jitter.sleeps}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
