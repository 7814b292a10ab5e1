"""The per-rank online batcher: fill the window -> propose -> one DGAP round -> apply the decision.

Usage on every rank (the same calls, in lockstep)::

    batcher = OnlineBatcher(config, comm, dataset_size=N, feed=feed, num_epochs=2)
    for step in batcher:            # StepPlan: GAS micro-batches + the step's global label tokens
        train(step)

A uid is ``epoch * dataset_size + dataset_index``. The batcher talks to the other ranks through
its :class:`~odb.batching.align.Communicator` and to the data through a :class:`Feed`; which uids
this rank trains is :class:`~odb.batching.stream.UidStream`'s business, how they are packed the
packer's, and what every rank does in a round :func:`~odb.batching.decide.decide`'s.

Resume: ``batcher.load_state_dict(state)``, then ``feed.restore(batcher.held_uids())`` (the
samples of the window and of the planned steps, processed again by the caller), nothing else:
uids are dealt to the feed lazily, at the next round (construction deals nothing either).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from odb.batching.align import Aligner, Communicator, PeerStopped
from odb.batching.config import OdbConfig
from odb.batching.cost import CostModel, sequence_parallel_degrees
from odb.batching.feed import Feed
from odb.batching.fit import CostFit, Fitted, Observation, features
from odb.batching.mixture import Mixture
from odb.batching.packer import make_packer
from odb.batching.plan import Decision, MicroBatch, Shared, StepPlan
from odb.batching.state import Snapshot, decode_state, encode_state
from odb.batching.stats import BatcherStats
from odb.batching.stream import Reader, UidStream
from odb.batching.wire import Layout, Proposal

__all__ = ["Feed", "OnlineBatcher", "features"]


class OnlineBatcher:
    """One rank's batcher. Construction is collective (it checks settings across ranks).

    Args:
        config: odb settings (identical on every rank; checked).
        comm: the rank's communicator.
        dataset_size: number of samples in the dataset (all ranks).
        feed: deals, fetches and forgets this rank's samples by uid (:class:`Feed`).
        num_epochs: epochs to run in join mode (quota mode runs until the quota).
        shards: optional explicit per-rank lists of dataset indices (static sharding only).
        report / on_reports: this rank's telemetry vector for the next round (a packed row, as long
            as it is) and, after the round, every rank's (``[world, len]``, the shorter zero-padded);
            see :mod:`odb.telemetry`.
        settings: further settings every rank must share (e.g. the run's precision, the data's
            fingerprint), checked with the batcher's own in the same one collective.
        mixture: a weighted mixture of sources (:mod:`odb.batching.mixture`).
        reader: this rank's reader of a streaming source (:class:`odb.batching.stream.Reader`;
            ``dataset_size``: the uid space of one pass).
    """

    def __init__(self, config: OdbConfig, comm: Communicator, *, dataset_size: int, feed: Feed,
                 num_epochs: int = 1, shards: list[list[int]] | None = None,
                 report: Callable[[], np.ndarray] | None = None,
                 on_reports: Callable[[np.ndarray], None] | None = None,
                 settings: dict[str, Any] | None = None, mixture: Mixture | None = None,
                 reader: Reader | None = None) -> None:
        if dataset_size < 0 or num_epochs < 1:
            raise ValueError(f"need dataset_size >= 0 and num_epochs >= 1, got {dataset_size}, {num_epochs}")
        self.config, self.feed = config, feed
        self.aligner = Aligner(comm)
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dataset_size, self.num_epochs = dataset_size, num_epochs
        self.report, self.on_reports = report, on_reports  # telemetry riding on each round
        if mixture is not None and (mixture.dataset_size != dataset_size or mixture.quota != (config.mode == "quota")):
            raise ValueError(f"the mixture covers {mixture.dataset_size} records (quota {mixture.quota}) and the "
                             f"batcher {dataset_size} (mode {config.mode!r}): build it for this dataset and mode")
        self.mixture = mixture
        self.stream = UidStream(config, rank=self.rank, world_size=self.world_size, dataset_size=dataset_size,
                                shards=shards, mixture=mixture, reader=reader)
        self.cost_model = CostModel.from_config(config, sequence_parallel_degrees(config.max_sp, self.world_size))
        self.packer = make_packer(config, self.cost_model)
        if reader is not None and self.packer.is_offline:
            raise ValueError(f"policy {config.policy!r} sorts a rank's whole shard before it forms a micro-batch, and "
                             "a streaming source has no shard to hold whole: use policy 'odb' (or 'fixed')")
        self.fit = (CostFit(rank=self.rank, attn_coef=config.attn_coef, patch_coef=config.patch_coef,
                            a2a_coef=config.a2a_coef, world_size=self.world_size)
                    if config.cost_model == "fit" else None)
        self.is_warm = False  # this process has trained a step: the first's times are not the run's pace
        # the observed cost figures as sent: held under what every rank's together fit in an int64
        # (squared costs of a long run at long contexts would not; the dealer's estimate then saturates)
        self._observed_cap = (1 << 62) // max(1, self.world_size)
        # the samples a round's vector has room for: an offline packer (gmt, bmt) proposes all it
        # holds, which after a re-deal onto fewer ranks between epochs is one epoch's queued steps
        # and the next one's shard; never more than the run's uids (join mode: those baselines have no quota)
        self.capacity = (dataset_size * num_epochs if self.packer.is_offline
                         else config.window + config.lookahead)
        self.aligner.check_settings({**(settings or {}), **config.to_dict(), "world_size": self.world_size,
                                     "dataset_size": dataset_size, "num_epochs": num_epochs,
                                     "explicit_shards": shards is not None, "streaming": reader is not None,
                                     "mixture": None if mixture is None else [mixture.sizes, mixture.weights,
                                                                              mixture.mix_by, mixture.epoch_rule]})
        if config.mode == "quota" and self.stream.total_size == 0:
            raise ValueError("quota mode needs a non-empty dataset")
        self.round_index = self.step_index = 0
        self.num_emitted = 0  # samples trained over all ranks (identical on every rank)
        self.queue: deque[StepPlan] = deque()
        self.observed_cost = self.observed_cost_sq = self.observed_samples = 0
        self.counts = {"truncated": 0, "truncated_tokens": 0, "dropped": 0, "skipped": 0, "long": 0}
        self.fatal: Exception | None = None
        self.is_planned = False  # every step of the run is planned (some may still be queued): no more rounds
        # Time in odb's own planning (packing, decisions, dealing), in waiting for processed
        # samples and in collectives: telemetry, not state.
        self.plan_s = self.fetch_s = 0.0
        self.stream.start_epoch()  # decided now, dealt to the feed at the first round

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    @property
    def stats(self) -> BatcherStats:
        """What this rank's batcher has counted so far (a snapshot)."""
        counts = self.counts
        return BatcherStats(rounds=self.round_index, fetch_s=self.fetch_s, plan_s=self.plan_s,
                            collective_s=self.aligner.collective_s, observed_samples=self.observed_samples,
                            skipped=counts["skipped"], dropped=counts["dropped"], truncated=counts["truncated"],
                            truncated_tokens=counts["truncated_tokens"], long=counts["long"])

    @property
    def cost_fit(self) -> Fitted | None:
        """The fitted coefficients in effect (``cost_model: "fit"``), None before the first fit."""
        return self.fit.fitted if self.fit is not None else None

    def observe(self, plan: StepPlan, seconds: list[float]) -> None:
        """This rank's forward time of each micro-batch of a step it trained
        (``cost_model: "fit"``; nothing otherwise): they join the fit at the next round. The first
        step of a process is left out (allocations, kernel choices: not the run's pace), and so
        are dummies."""
        if self.fit is None:
            return
        if not self.is_warm:
            self.is_warm = True
            return
        for micro, time_s in zip(plan.micro_batches, seconds, strict=True):
            if not micro.is_dummy:
                tokens, area, patches, a2a = features(micro)
                self.fit.observe(Observation(tokens, area, patches, round(time_s * 1e6), a2a))

    def gather_reports(self, values) -> np.ndarray:
        """The run's final collective (:meth:`odb.batching.align.Aligner.gather_reports`): every
        rank's ``values`` (telemetry riding on no round, a packed row: :meth:`odb.batching.wire.Layout.pack`)."""
        return self.aligner.gather_reports(values, ragged=True)

    @property
    def last_reports(self) -> np.ndarray:
        """Every rank's telemetry of the last round gathered (empty before the first)."""
        return self.aligner.reports

    @property
    def is_done(self) -> bool:
        """Whether the run is over: every step is planned (:attr:`is_planned`) and none is left
        in the queue. Planning ends in the last round, which may plan several steps: until they
        are handed out the run is not done (a checkpoint taken between them resumes them)."""
        return self.is_planned and not self.queue

    def held_uids(self) -> list[int]:
        """uids whose samples this rank holds: its window and its planned, untrained steps."""
        return [s.uid for s in self.packer.held()] + [u for step in self.queue for m in step.micro_batches
                                                      for u in m.uids]

    def __iter__(self) -> Iterator[StepPlan]:
        while True:
            while not self.queue and not self.is_planned:
                self._round()
            if not self.queue:
                return
            yield self.queue.popleft()

    # ---- one round: fill -> propose -> round -> apply ----------------------------------------

    def _round(self) -> None:
        start, waited = time.perf_counter(), self.fetch_s + self.aligner.collective_s
        self._fill_window()
        quota_left = self.config.quota - self.num_emitted if self.config.mode == "quota" else None
        try:
            decision = self.aligner.round(
                self._proposal(), max_bins=self.capacity, max_samples=self.capacity, gas=self.config.gas,
                seed=self.config.seed, epoch=self.epoch, round_index=self.round_index,
                quota_left=quota_left, stream_left=self.stream.left(), inflight_target=self.stream.inflight_target,
                stream_ready=self.stream.ready(), window=self.config.window,
                max_tokens=self.cost_model.max_tokens, degrees=self.cost_model.degrees,
                report=self.report() if self.report else None, extra=self._extra())
        except PeerStopped:
            if self.fatal is not None:
                raise self.fatal from None  # this rank's own error, with its message
            raise
        epoch = self.epoch
        self._apply(decision)
        if self.mixture is not None and self.epoch == epoch:  # (a new epoch counts afresh)
            self.mixture.merge(self.aligner.extra)  # after the deal, which drew on the last round's sums
        if self.fit is not None and self.fit.merge(self.aligner.extra):
            self._reprice()
        self._deal()
        waited = self.fetch_s + self.aligner.collective_s - waited
        self.plan_s += time.perf_counter() - start - waited
        if self.on_reports:
            self.on_reports(self.aligner.reports)

    def _extra(self) -> tuple[Layout, dict[str, Any]] | None:
        """What rides on the round beside the proposal: the cost fit's times, the mixture's counts."""
        parts = [(part.layout, part.fields()) for part in (self.fit, self.mixture) if part is not None]
        if not parts:
            return None
        layout, values = parts[0]
        for more, fields in parts[1:]:
            layout, values = layout.then(more), {**values, **fields}
        return layout, values

    def _deal(self) -> None:
        uids = self.stream.undealt()
        if uids:
            self.feed.deal(uids)

    def _fill_window(self) -> None:
        self.stream.top_up()
        self._deal()
        want = self.config.window - self.packer.num_samples
        if self.packer.is_offline:
            want = len(self.stream.pending)  # the whole shard
        elif self.stream.is_tail():  # the stream's tail, to observe it all (within the round vector's room)
            want = min(len(self.stream.pending), self.capacity - self.packer.num_samples)
        uids = self.stream.take(max(0, want))
        if not uids:
            return
        start = time.perf_counter()
        try:
            raw = self.feed.fetch(uids)
            self.fetch_s += time.perf_counter() - start
            admitted, outcomes = self.cost_model.measure_many(uids, raw)
        except Exception as err:  # noqa: BLE001 - bad data under strict, over-cap error, a dead worker
            self.fatal = err  # told to every rank in this round's vector; raised after it
            return
        if len(admitted) < len(uids):
            kept = {s.uid for s in admitted}
            self.feed.forget([u for u in uids if u not in kept])
        if self.mixture is not None:
            self.mixture.observe(uids, admitted)
        self.stream.observe(uids, admitted)  # (a streamed mixture's reader draws by what it measures)
        for outcome, count in outcomes.items():
            self.counts[outcome] += count
        self.observed_cost += sum(s.cost for s in admitted)
        self.observed_cost_sq += sum(s.cost * s.cost for s in admitted)
        self.observed_samples += len(admitted)
        self.packer.add(admitted)

    def _proposal(self) -> Proposal:
        is_exhausted = self.stream.is_exhausted()
        num_ready = self.packer.pack(self.config.window, is_exhausted, min_bins=self.config.gas)
        bins = self.packer.bins
        is_quota = self.config.mode == "quota"  # quota closure may cut a bin: price its samples
        return Proposal(
            is_fatal=self.fatal is not None, is_exhausted=is_exhausted, num_ready=num_ready,
            window_samples=self.packer.num_samples, window_cost=sum(b.cost for b in bins),
            num_pending=len(self.stream.pending), observed_cost=min(self.observed_cost, self._observed_cap),
            observed_cost_sq=min(self.observed_cost_sq, self._observed_cap), observed_samples=self.observed_samples,
            is_first_pass_open=self.stream.is_first_pass_open(), num_skipped=self.counts["skipped"],
            num_dropped=self.counts["dropped"],
            bin_costs=[b.cost for b in bins], bin_samples=[len(b.samples) for b in bins],
            bin_tokens=[b.tokens for b in bins], bin_labels=[sum(s.label_tokens for s in b.samples) for b in bins],
            sample_labels=[s.label_tokens for b in bins for s in b.samples] if is_quota else None,
            sample_tokens=[s.tokens for b in bins for s in b.samples] if is_quota else None,
            sample_costs=[c for b in bins for c in b.cost_steps(self.cost_model)] if is_quota else None)

    def _apply(self, decision: Decision) -> None:
        mine, gas = decision.slots[self.rank].tolist(), self.config.gas
        taken = self.packer.take(b for b in mine if b >= 0)
        if decision.cut is not None and decision.cut[0] == self.rank:
            _, b, keep = decision.cut
            taken[b], _ = taken[b].split(keep, self.cost_model)
        owners = decision.shared[self.rank].tolist() if decision.shared is not None else [-1] * len(mine)
        micro = []
        for p, (b, owner) in enumerate(zip(mine, owners, strict=True)):
            shared = None
            if owner >= 0:  # a long sample, trained by a group of ranks together
                tokens = int(decision.slot_tokens[owner, p])
                shared = Shared(owner, self.cost_model.degree(tokens), tokens)
            micro.append(MicroBatch(tuple(taken[b].samples), taken[b].padded, shared) if b >= 0
                         else MicroBatch((), shared=shared))
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
            self.stream.deal(decision.new_indices)
        if decision.is_quota_done:
            self.is_planned = True
        elif decision.is_epoch_done:
            assert not self.packer.num_samples and not self.stream.pending, "epoch ended with samples left"
            self._next_epoch()

    def remeasure(self, sizes: dict[int, tuple | None]) -> None:
        """The held samples whose sizes (``sizes``, by uid, as :meth:`Feed.fetch` gives them; None: the
        data layer now skips it) differ from what was planned, measured again (or left out, counted as
        skipped): after a resume whose data layer cuts otherwise (on fewer ranks, over_cap
        'sequence_parallel''s largest group is smaller). Queued steps are left as planned (a resume on
        the same ranks processes alike)."""
        def again(samples):
            kept = []
            for sample in samples:
                if sample.uid not in sizes:
                    kept.append(sample)
                elif sizes[sample.uid] is None:
                    self.counts["skipped"] += 1
                else:
                    kept.append(self.cost_model.measure_again(sample, sizes[sample.uid]))
            return kept

        self.packer.restore([b for b in (again(b.samples) for b in self.packer.bins) if b],
                            again(self.packer.unpacked))

    def _reprice(self) -> None:
        """The fit's new coefficients: the window's samples priced with them, and the observed cost
        figures (the dealer's estimate of samples not fetched yet) scaled as the window's cost moved."""
        before = sum(s.cost for s in self.packer.held())
        self.cost_model.set_coefficients(*self.fit.coefficients)
        self.packer.reprice()
        if before:
            ratio = sum(s.cost for s in self.packer.held()) / before
            self.observed_cost = round(self.observed_cost * ratio)
            self.observed_cost_sq = round(self.observed_cost_sq * ratio * ratio)

    def _next_epoch(self) -> None:
        self.stream.next_epoch()
        if self.config.mode == "join" and self.epoch >= self.num_epochs:
            self.is_planned = True
        else:
            self.stream.start_epoch()

    # ---- state (I6): encoded and checked by odb.batching.state --------------------------------

    def state_dict(self) -> dict:
        """Plain, JSON-able state; loading it into a fresh batcher reproduces the remaining plan
        (with ``cost_model: "fit"``, as far as the measured times are the same)."""
        snapshot = Snapshot(
            stream=self.stream.state_dict(), round_index=self.round_index, step_index=self.step_index,
            num_emitted=self.num_emitted, bins=[list(b.samples) for b in self.packer.bins],
            unpacked=list(self.packer.unpacked), queue=list(self.queue),
            observed=(self.observed_cost, self.observed_cost_sq, self.observed_samples),
            counts=dict(self.counts), is_planned=self.is_planned,
            fit=self.fit.state_dict() if self.fit is not None else None,
            mixture=self.mixture.state_dict() if self.mixture is not None else None)
        return encode_state(snapshot, num_epochs=self.num_epochs, **self._identity())

    def load_state_dict(self, state: dict) -> None:
        """Loads :meth:`state_dict` (never mutating it). The steps it had queued come first; a
        join-mode state whose planning was over, loaded with more ``num_epochs``, then starts the
        next epoch; one of an epoch ``num_epochs`` never reaches is refused. The pending uids go to
        the feed at the next round."""
        s = decode_state(state, **self._identity())
        begun = [step.epoch for step in s.queue[-1:]] + ([] if s.is_planned else [s.stream["epoch"]])
        resumes = max(begun, default=-1)  # the latest epoch the state began and did not finish
        if self.config.mode == "join" and resumes >= self.num_epochs:
            raise ValueError(f"the state was taken in epoch {resumes + 1} of the run, which a run of {self.num_epochs} "
                             f"epoch(s) never trains: resume with --epochs {resumes + 1} or more, or start a new run")
        self.stream.load_state_dict(s.stream)
        self.round_index, self.step_index, self.num_emitted = s.round_index, s.step_index, s.num_emitted
        self.packer.restore(s.bins, s.unpacked)
        self.queue = deque(s.queue)
        self.observed_cost, self.observed_cost_sq, self.observed_samples = s.observed
        self.counts, self.is_planned = {**dict.fromkeys(self.counts, 0), **s.counts}, s.is_planned
        if (s.mixture is None) != (self.mixture is None):
            raise ValueError("the state was taken " + ("with" if s.mixture is not None else "without")
                             + " a weighted data mixture and this run is the other way: resume with the same data")
        if self.mixture is not None:
            self.mixture.load_state_dict(s.mixture)
        if self.fit is not None and s.fit is not None:  # (a state of a run without the fit: it starts now)
            self.fit.load_state_dict(s.fit)
            self.cost_model.set_coefficients(*self.fit.coefficients)
        # priced as this run prices: samples re-dealt from another world size's queues were priced
        # when planned, and a resume may change the cost model (odb.batching.state.RESUMABLE_CHANGES)
        self.packer.reprice()
        if self.is_planned and self.config.mode == "join" and self.epoch < self.num_epochs:
            self.is_planned = False  # resumed with more epochs: the next one starts (after the queued steps)
            self.stream.start_epoch()

    def _identity(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "config": self.config.to_dict(),
                "dataset_size": self.dataset_size}
