"""tools/bench/bench_trl_dpo.py's own logic: the seeded pairs and their rule, the held-out split,
each system's eval curve (steps, training seconds) from its records, and the time to target
against a brute-force scan."""

import json
import random

import pytest

from tools.bench import bench_trl_dpo as bench


def words(record: dict, key: str) -> list[str]:
    text = record[key][0]["content"]
    return text.removeprefix(bench.PROMPT).split() if key == "prompt" else text.split()


def test_the_pairs_are_seeded_distinct_and_follow_the_rule():
    pairs = bench.make_pairs(300, 5, max_answer_words=40)
    assert pairs == bench.make_pairs(300, 5, max_answer_words=40)
    assert pairs != bench.make_pairs(300, 6, max_answer_words=40)
    assert len({json.dumps(p) for p in pairs}) == 300
    groups = {w: g for g, group in enumerate(bench.GROUPS) for w in group}
    for p in pairs:
        prompt_group = {groups[w] for w in words(p, "prompt")}
        assert len(prompt_group) == 1 and len(words(p, "prompt")) >= 2
        (group,) = prompt_group
        assert {groups[w] for w in words(p, "chosen")} == {group}
        assert {groups[w] for w in words(p, "rejected")} == {1 - group}
        assert all(1 <= len(words(p, key)) <= 40 for key in ("chosen", "rejected"))
    # the two answers' lengths are drawn apart: rarely equal, and either may be the longer
    lengths = [(len(words(p, "chosen")), len(words(p, "rejected"))) for p in pairs]
    assert sum(c == r for c, r in lengths) < 60
    assert any(c > r for c, r in lengths) and any(c < r for c, r in lengths)
    assert {sum(groups[words(p, "prompt")[0]] == g for p in pairs) for g in (0, 1)} <= set(range(100, 201))


def test_the_split_is_disjoint_whole_and_seeded():
    pairs = bench.make_pairs(200, 0)
    train, held_out = bench.split_pairs(pairs, 50, seed=3)
    assert len(train) == 150 and len(held_out) == 50
    train_keys, eval_keys = {json.dumps(p) for p in train}, {json.dumps(p) for p in held_out}
    assert not train_keys & eval_keys and train_keys | eval_keys == {json.dumps(p) for p in pairs}
    assert bench.split_pairs(pairs, 50, seed=3) == (train, held_out)
    assert bench.split_pairs(pairs, 50, seed=4)[1] != held_out
    for bad in (0, 200):
        with pytest.raises(ValueError, match="--eval_pairs"):
            bench.split_pairs(pairs, bad, seed=0)


def brute_force(curve, target):
    """The earliest step whose accuracy is at or over the target, by looking at every point."""
    hits = [(step, seconds) for step, seconds, accuracy in curve if accuracy >= target]
    return min(hits) if hits else None


@pytest.mark.parametrize("seed", range(40))
def test_first_reach_equals_a_brute_force_scan(seed):
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, 200), rng.randrange(0, 12)))
    seconds = sorted(rng.uniform(0, 100) for _ in steps)
    curve = [(s, t, rng.choice([0.5, 0.75, 0.8, 0.9, 1.0, rng.random()])) for s, t in zip(steps, seconds)]
    target = rng.choice([0.8, 0.9, rng.random()])
    assert bench.first_reach(curve, target) == brute_force(curve, target)


def test_first_reach_counts_the_target_itself_and_a_later_dip_does_not_undo_it():
    curve = [(10, 1.0, 0.5), (20, 2.0, 0.9), (30, 3.0, 0.4), (40, 4.0, 0.95)]
    assert bench.first_reach(curve, 0.9) == (20, 2.0)
    assert bench.first_reach(curve, 0.96) is None


def test_the_curves_count_the_steps_trained_and_their_seconds_without_the_evaluations():
    # odb: a row's step is its index from 0; an eval row follows the step of its index
    rows = [{"step": i, "step_s": 0.5 * (i + 1)} for i in range(4)]
    rows.insert(2, {"step": 1, "eval_s": 9.0, "eval_rewards/accuracies": 0.7})
    rows.append({"step": 3, "eval_s": 9.0, "eval_rewards/accuracies": 0.8})
    curve, step_s = bench.curve_from_odb(rows)
    assert step_s == [0.5, 1.0, 1.5, 2.0]
    assert curve == [(2, 1.5, 0.7), (4, 5.0, 0.8)]
    # TRL: log_history's step is the number of steps done
    run = {"step_s": [0.5, 1.0, 1.5, 2.0],
           "log_history": [{"step": 2, "loss": 0.6}, {"step": 2, "eval_rewards/accuracies": 0.7},
                           {"step": 4, "eval_rewards/accuracies": 0.8}]}
    assert bench.curve_from_trl(run) == ([(2, 1.5, 0.7), (4, 5.0, 0.8)], run["step_s"])
