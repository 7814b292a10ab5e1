"""I4 (N_step) with samples that have a prompt: the label tokens a step trains, counted from the
samples' own labels (tests/conftest.py's ``kept_label_tokens``: the first ``max_tokens`` tokens,
as the collate keeps them, every position but the first, no -100), against the batcher's plan.

The simulations elsewhere have no prompt (every token a label), where a cut sample keeps
``max_tokens - 1`` label tokens however it is cut. Here the labels sit after a prompt, so a
sample cut to ``max_tokens`` keeps only the labels inside its first ``max_tokens`` tokens."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from conftest import check_aligned, check_exact_once, check_label_tokens
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig
from odb.batching.simulate import run_ranks


class LabelledFeed:
    """A :class:`~odb.batching.feed.Feed` over samples given by their labels (-100 for the prompt),
    each reported whole, as a data layer that cuts nothing reports it: ``(tokens, label_tokens, 0)``
    (label tokens: positions after the first, not -100), with the labels themselves as a fourth
    element when ``with_labels``."""

    def __init__(self, samples: list[list[int]], with_labels: bool = True) -> None:
        self.samples, self.with_labels, self.queue = samples, with_labels, deque()

    def deal(self, uids: list[int]) -> None:
        self.queue.extend(uids)

    def fetch(self, uids: list[int]) -> list[tuple | None]:
        out = []
        for uid in uids:
            assert self.queue.popleft() == uid
            labels = self.samples[uid % len(self.samples)]
            sizes = (len(labels), sum(1 for label in labels[1:] if label != -100), 0)
            out.append((*sizes, list(labels)) if self.with_labels else sizes)
        return out

    def forget(self, uids: list[int]) -> None:
        pass


def chat(prompt: int, answer: int) -> list[int]:
    """A sample's labels: ``prompt`` tokens without a label, then ``answer`` labelled tokens."""
    return [-100] * prompt + [1] * answer


def plan(config: OdbConfig, samples: list[list[int]], world: int, with_labels: bool = True):
    def rank_main(comm):
        feed = LabelledFeed(samples, with_labels)
        batcher = OnlineBatcher(config, comm, dataset_size=len(samples), feed=feed)
        return list(batcher)

    return run_ranks(world, rank_main, timeout_s=30)


def check(config: OdbConfig, samples: list[list[int]], world: int) -> None:
    steps = plan(config, samples, world)
    check_aligned(steps)
    check_exact_once(steps, Counter(range(len(samples))))
    check_label_tokens(steps, lambda uid: samples[uid % len(samples)], config.max_tokens)


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
@pytest.mark.parametrize("world", [2, 3])
def test_n_step_counts_the_labels_after_the_prompt(sharding, world):
    """Samples with prompts under the cap (nothing cut), and over-cap samples without one."""
    rng = random.Random(world)
    samples = [chat(rng.randint(0, 40), rng.randint(1, 40)) for _ in range(60)]  # at most 80 tokens
    samples += [chat(0, rng.randint(101, 300)) for _ in range(10)]  # cut: all of the kept tokens are labels
    config = OdbConfig(max_tokens=100, window=8, gas=2, sharding=sharding, lookahead=2, over_cap="truncate")
    check(config, samples, world)


@pytest.mark.parametrize("world", [1, 2])
def test_n_step_counts_only_the_labels_a_cut_sample_keeps(world):
    """Over-cap samples with prompts, cut under over_cap 'truncate' by the batcher itself (a feed
    that reports samples whole, with their labels; odb's own SampleFeed cuts them before): one with
    a prompt longer than the cap keeps no label, the others part of theirs."""
    samples = [chat(10, 10), chat(2, 18), chat(3, 4), chat(30, 5)] * 2
    config = OdbConfig(max_tokens=8, window=4, gas=1, over_cap="truncate")
    check(config, samples, world)


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_cut_samples_with_prompts_over_ranks_and_rounds(sharding):
    """Randomized: prompts and answers of every size, a third of the samples over the cap, 3 ranks."""
    rng = random.Random(7)
    samples = [chat(rng.randint(0, 150), rng.randint(1, 150)) for _ in range(90)]
    config = OdbConfig(max_tokens=100, window=8, gas=2, sharding=sharding, lookahead=2, over_cap="truncate")
    check(config, samples, 3)


def test_a_cut_sample_with_a_prompt_and_no_labels_stops_the_run_naming_the_fix():
    """Sizes alone cannot say how many labels a cut prefix keeps: the run stops with what to give."""
    samples = [chat(3, 4), chat(10, 10)]
    config = OdbConfig(max_tokens=8, window=4, gas=1, over_cap="truncate")
    with pytest.raises(Exception, match=r"4th element: \(tokens, label_tokens, patches, labels\)"):
        plan(config, samples, 1, with_labels=False)


def test_without_labels_a_cut_sample_that_is_all_labels_or_none_is_counted_exactly():
    """No prompt (every position a label) or no label at all: the sizes say what the prefix keeps."""
    samples = [chat(0, 20), chat(20, 0), chat(3, 4), chat(0, 30)] * 2
    config = OdbConfig(max_tokens=8, window=4, gas=1, over_cap="truncate")
    steps = plan(config, samples, 2, with_labels=False)
    check_aligned(steps)
    check_label_tokens(steps, lambda uid: samples[uid % len(samples)], config.max_tokens)
