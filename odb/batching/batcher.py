"""The per-rank online batcher: window -> packer -> DGAP round -> step plans.

Usage on every rank (the same calls, in lockstep)::

    batcher = OnlineBatcher(config, comm, dataset_size=N, fetch=fetch, num_epochs=2)
    for step in batcher:            # StepPlan: GAS micro-batches + the step's global label tokens
        train(step)

``fetch(uids)`` returns ``(tokens, label_tokens, patches)`` for each processed sample, in order
(``None`` for a record the data layer skipped);
a uid is ``epoch * dataset_size + dataset_index``. ``on_deal(uids)`` is told, in fetch order,
every uid dealt to this rank (feed them to the DataLoader's sampler); :meth:`held_uids` lists the
samples a resumed batcher still needs (processed again after loading a state).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from odb.batching.align import Aligner, Communicator, PeerStopped
from odb.batching.config import OdbConfig
from odb.batching.cost import CostModel, SampleCost
from odb.batching.packer import make_packer
from odb.batching.plan import Decision, MicroBatch, Proposal, StepPlan, deal_budget
from odb.batching.state import STATE_VERSION, check_state, decode_steps, encode_steps

__all__ = ["OnlineBatcher", "epoch_order"]

Fetch = Callable[[list[int]], list[tuple[int, int, int] | None]]


def epoch_order(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
    """The shared, seeded order of dataset indices for one epoch (identical on every rank)."""
    return np.random.default_rng([seed, epoch]).permutation(dataset_size)


class OnlineBatcher:
    """One rank's batcher. Construction is collective (it checks settings across ranks).

    Args:
        config: odb settings (identical on every rank; checked).
        comm: the rank's communicator.
        dataset_size: number of samples in the dataset (all ranks).
        fetch: processes samples by uid (see module docstring).
        num_epochs: epochs to run in join mode (quota mode runs until the quota).
        shards: optional explicit per-rank lists of dataset indices (static sharding only).
        on_deal: told every uid dealt to this rank, in fetch order (feeds a DataLoader sampler).
        on_drop: told the fetched uids that will not be trained (skipped, or dropped over the cap).
        report / on_reports: this rank's telemetry vector for the next round (same length on every
            rank) and, after the round, every rank's (``[world, len]``); see :mod:`odb.telemetry`.
    """

    def __init__(self, config: OdbConfig, comm: Communicator, *, dataset_size: int, fetch: Fetch,
                 num_epochs: int = 1, shards: list[list[int]] | None = None,
                 on_deal: Callable[[list[int]], None] | None = None,
                 on_drop: Callable[[list[int]], None] | None = None,
                 report: Callable[[], np.ndarray] | None = None,
                 on_reports: Callable[[np.ndarray], None] | None = None) -> None:
        if dataset_size < 0 or num_epochs < 1:
            raise ValueError(f"need dataset_size >= 0 and num_epochs >= 1, got {dataset_size}, {num_epochs}")
        if shards is not None and config.sharding != "static":
            raise ValueError("explicit shards need sharding='static'")
        if config.policy in ("gmt", "bmt") and config.sharding != "static":
            raise ValueError(f"policy {config.policy!r} needs every length of its shard first; "
                             "set sharding 'static'")
        self.config = config
        self.aligner = Aligner(comm)
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dataset_size = dataset_size
        self.num_epochs = num_epochs
        self.fetch = fetch
        self.on_deal = on_deal or (lambda uids: None)
        self.on_drop = on_drop
        self.report, self.on_reports = report, on_reports  # telemetry riding on each round
        self.shards = shards
        self.cost_model = CostModel.from_config(config)
        self.packer = make_packer(config, self.cost_model)
        self.capacity = dataset_size if self.packer.is_offline else config.window + config.lookahead
        self.aligner.check_settings({**config.to_dict(), "world_size": self.world_size,
                                     "dataset_size": dataset_size, "num_epochs": num_epochs,
                                     "explicit_shards": shards is not None})
        if config.mode == "quota" and self._total_shard_size() == 0:
            raise ValueError("quota mode needs a non-empty dataset")
        self.epoch = 0
        self.round_index = 0
        self.step_index = 0
        self.stream_pos = 0  # dynamic sharding: next position in the shared stream (all epochs)
        self.num_emitted = 0  # samples trained over all ranks (identical on every rank)
        self.pending: list[int] = []  # dealt, not yet fetched, in fetch order
        self.queue: deque[StepPlan] = deque()
        self.observed_cost = 0
        self.observed_cost_sq = 0
        self.observed_samples = 0
        self.counts = {"truncated": 0, "dropped": 0, "skipped": 0}
        self.fatal: Exception | None = None
        self.is_done = False
        # Time in odb's own planning (packing, decisions, dealing), in waiting for processed
        # samples and in collectives: telemetry, not state.
        self.plan_s = self.fetch_s = 0.0
        self.epoch_of_shard = 0
        self._order_epoch = -1
        self._start_epoch()

    # ---- the stream of uids -------------------------------------------------------------------

    def _total_shard_size(self) -> int:
        return sum(len(s) for s in self.shards) if self.shards is not None else self.dataset_size

    def _stream_uids(self, start: int, stop: int) -> list[int]:
        """uids at positions [start, stop) of the shared stream (epoch after epoch)."""
        size, out = self.dataset_size, []
        while start < stop:
            epoch, offset = divmod(start, size)
            end = min(stop, (epoch + 1) * size)
            out.extend((self._order(epoch)[offset:offset + end - start] + epoch * size).tolist())
            start = end
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order_cache = epoch_order(self.config.seed, epoch, self.dataset_size)
            self._order_epoch = epoch
        return self._order_cache

    def _static_shard(self, epoch: int) -> list[int]:
        if self.shards is not None:
            indices = self.shards[self.rank]
        else:
            indices = self._order(epoch)[self.rank::self.world_size].tolist()
        return [epoch * self.dataset_size + int(i) for i in indices]

    def _static_shard_size(self) -> int:
        if self.shards is not None:
            return len(self.shards[self.rank])
        return len(range(self.rank, self.dataset_size, self.world_size))

    def _stream_left(self) -> int | None:
        if self.config.sharding == "static":
            return None
        if self.config.mode == "quota":
            return 1 << 62
        return (self.epoch + 1) * self.dataset_size - self.stream_pos

    def _deal(self, counts: list[int]) -> None:
        start = self.stream_pos + sum(counts[:self.rank])
        mine = self._stream_uids(start, start + counts[self.rank])
        self.pending.extend(mine)
        self.on_deal(mine)
        self.stream_pos += sum(counts)

    def _start_epoch(self) -> None:
        if self.config.sharding == "static":
            shard = self._static_shard(self.epoch)
            self.pending.extend(shard)
            self.on_deal(shard)
        else:
            per_rank = self.config.window + self.config.lookahead
            # nothing observed yet: assume a spread of 1 (coefficient of variation of cost)
            total = min(self.world_size * per_rank,
                        deal_budget(self._stream_left(), self.world_size, per_rank, spread=1.0))
            base, extra = divmod(total, self.world_size)
            self._deal([base + (r < extra) for r in range(self.world_size)])

    def _is_tail(self) -> bool:
        left = self._stream_left()
        return left is not None and left <= self.world_size * (self.config.window + self.config.lookahead)

    def _is_exhausted(self) -> bool:
        if self.pending:
            return False
        if self.config.sharding == "static":
            return self.config.mode == "join" or not self._static_shard_size()
        return self._stream_left() == 0

    # ---- what callers see --------------------------------------------------------------------

    def held_uids(self) -> list[int]:
        """uids whose samples this rank holds: its window and its planned, untrained steps."""
        held = [s.uid for b in self.packer.bins for s in b.samples]
        held += [s.uid for s in self.packer.unpacked]
        held += [u for step in self.queue for m in step.micro_batches for u in m.uids]
        return held

    def wanted(self) -> list[int]:
        """The uids the next round will fetch (the head of this rank's pending queue)."""
        want = self.config.window - self.packer.num_samples
        if self.packer.is_offline or self._is_tail():
            want = len(self.pending)  # the whole shard; or the stream's tail, to observe it all
        return self.pending[:max(0, want)]

    def __iter__(self) -> Iterator[StepPlan]:
        while True:
            while not self.queue and not self.is_done:
                self._round()
            if not self.queue:
                return
            yield self.queue.popleft()

    # ---- one round ---------------------------------------------------------------------------

    def _fill_window(self) -> None:
        if self.config.sharding == "static" and self.config.mode == "quota":
            while len(self.pending) < self.config.window + self.config.lookahead and self._static_shard_size():
                self.epoch_of_shard += 1  # the shard again, in the next epoch's order
                more = self._static_shard(self.epoch_of_shard)
                self.pending.extend(more)
                self.on_deal(more)
        uids = self.wanted()
        if not uids:
            return
        del self.pending[:len(uids)]
        start = time.perf_counter()
        try:
            raw = self.fetch(uids)
            self.fetch_s += time.perf_counter() - start
            admitted, outcomes = self.cost_model.measure_many(uids, raw)
        except Exception as err:  # noqa: BLE001 - bad data under strict, over-cap error, a dead worker
            self.fatal = err  # told to every rank in this round's vector; raised after it
            return
        if len(admitted) < len(uids) and self.on_drop:
            kept = {s.uid for s in admitted}
            self.on_drop([u for u in uids if u not in kept])
        for outcome, count in outcomes.items():
            self.counts[outcome] += count
        self.observed_cost += sum(s.cost for s in admitted)
        self.observed_cost_sq += sum(s.cost * s.cost for s in admitted)
        self.observed_samples += len(admitted)
        self.packer.add(admitted)

    def _proposal(self) -> Proposal:
        is_exhausted = self._is_exhausted()
        num_ready = self.packer.ranked(self.config.window, is_exhausted, min_bins=self.config.gas)
        bins = self.packer.bins
        is_quota = self.config.mode == "quota"  # quota closure may cut a bin: price its samples
        return Proposal(
            is_fatal=self.fatal is not None, is_exhausted=is_exhausted, num_ready=num_ready,
            window_samples=self.packer.num_samples, window_cost=sum(b.cost for b in bins),
            num_pending=len(self.pending), observed_cost=self.observed_cost,
            observed_cost_sq=self.observed_cost_sq, observed_samples=self.observed_samples,
            is_first_pass_open=self._is_first_pass_open(), num_skipped=self.counts["skipped"],
            num_dropped=self.counts["dropped"],
            bin_costs=[b.cost for b in bins], bin_samples=[len(b.samples) for b in bins],
            bin_tokens=[b.tokens for b in bins],
            sample_labels=[s.label_tokens for b in bins for s in b.samples],
            sample_tokens=[s.tokens for b in bins for s in b.samples] if is_quota else None,
            sample_costs=[c for b in bins for c in b.cost_steps(self.cost_model)] if is_quota else None)

    def _is_first_pass_open(self) -> bool:
        """Whether indices of the run's first pass over the data are still to be fetched here."""
        if self.config.sharding == "dynamic" and self.stream_pos < self.dataset_size:
            return True  # not all dealt yet
        return bool(self.pending) and self.pending[0] < self.dataset_size  # pending is in stream order

    def _round(self) -> None:
        start, waited = time.perf_counter(), self.fetch_s + self.aligner.collective_s
        self._fill_window()
        quota_left = self.config.quota - self.num_emitted if self.config.mode == "quota" else None
        try:
            decision = self.aligner.round(
                self._proposal(), max_bins=self.capacity, max_samples=self.capacity, gas=self.config.gas,
                seed=self.config.seed, epoch=self.epoch, round_index=self.round_index,
                quota_left=quota_left, stream_left=self._stream_left(),
                inflight_target=self.config.window + self.config.lookahead,
                report=self.report() if self.report else None)
        except PeerStopped:
            if self.fatal is not None:
                raise self.fatal from None  # this rank's own error, with its message
            raise
        self._apply(decision)
        waited = self.fetch_s + self.aligner.collective_s - waited
        self.plan_s += time.perf_counter() - start - waited
        if self.on_reports:
            self.on_reports(self.aligner.reports)

    def _apply(self, decision: Decision) -> None:
        mine = decision.slots[self.rank]
        num_taken = max((b + 1 for b in mine if b >= 0), default=0)
        taken = self.packer.take(num_taken)
        if decision.cut is not None and decision.cut[0] == self.rank:
            b, keep = decision.cut[1], decision.cut[2]
            taken[b], _ = taken[b].split(keep, self.cost_model)
        micro = [MicroBatch(tuple(taken[b].samples), taken[b].padded) if b >= 0 else MicroBatch(())
                 for b in mine]
        gas = self.config.gas
        costs = [tuple(c) for c in decision.slot_costs.T.tolist()]
        tokens = [tuple(t) for t in decision.slot_tokens.T.tolist()]
        for s, (n_step, n_samples) in enumerate(zip(decision.step_label_tokens, decision.step_samples)):
            at = slice(s * gas, (s + 1) * gas)
            self.queue.append(StepPlan(
                epoch=self.epoch, step=self.step_index, micro_batches=tuple(micro[at]),
                num_label_tokens=n_step, num_samples=n_samples, rank_costs=tuple(costs[at]),
                rank_tokens=tuple(tokens[at])))
            self.step_index += 1
        self.num_emitted += sum(decision.samples_taken)
        self.round_index += 1
        if any(decision.new_indices):
            self._deal(decision.new_indices)
        if decision.is_quota_done:
            self.is_done = True
        elif decision.is_epoch_done:
            assert not self.packer.num_samples and not self.pending, "epoch ended with samples left"
            self.epoch += 1
            if self.config.mode == "join" and self.epoch >= self.num_epochs:
                self.is_done = True
            else:
                self._start_epoch()

    # ---- state (I6) --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain, JSON-able state; loading it into a fresh batcher reproduces the remaining plan."""
        return {
            "version": STATE_VERSION, "world_size": self.world_size, "rank": self.rank,
            "config": self.config.to_dict(), "dataset_size": self.dataset_size,
            "num_epochs": self.num_epochs, "epoch": self.epoch, "round_index": self.round_index,
            "step_index": self.step_index, "stream_pos": self.stream_pos,
            "num_emitted": self.num_emitted, "pending": list(self.pending),
            "epoch_of_shard": self.epoch_of_shard,
            "bins": [[list(_sample_row(s)) for s in b.samples] for b in self.packer.bins],
            "unpacked": [list(_sample_row(s)) for s in self.packer.unpacked],
            "queue": encode_steps(self.queue), "observed": [self.observed_cost, self.observed_cost_sq, self.observed_samples],
            "counts": dict(self.counts), "is_done": self.is_done,
        }

    def load_state_dict(self, state: dict) -> None:
        check_state(state, world_size=self.world_size, rank=self.rank, config=self.config.to_dict(),
                    dataset_size=self.dataset_size)
        self.epoch, self.round_index = state["epoch"], state["round_index"]
        self.step_index, self.stream_pos = state["step_index"], state["stream_pos"]
        self.num_emitted = state["num_emitted"]  # num_epochs stays this run's: a resume may extend it
        self.pending = list(state["pending"])
        self.on_deal(list(self.pending))
        self.epoch_of_shard = state["epoch_of_shard"]
        self.packer.restore([[SampleCost(*row) for row in b] for b in state["bins"]],
                            [SampleCost(*row) for row in state["unpacked"]])
        self.queue = deque(decode_steps(state["queue"]))
        self.observed_cost, self.observed_cost_sq, self.observed_samples = state["observed"]
        self.counts = dict(state["counts"])
        self.is_done = state["is_done"]
        if self.is_done and self.config.mode == "join" and self.epoch < self.num_epochs:
            self.is_done = False  # a finished run resumed with more epochs: the next one starts
            self._start_epoch()


def _sample_row(s: SampleCost) -> tuple[int, int, int, int, int]:
    return (s.uid, s.tokens, s.label_tokens, s.patches, s.cost)
