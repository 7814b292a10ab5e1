"""global_batch_tokens: gas derived for the ranks at hand, so that an optimizer step carries about
the same tokens on 2 ranks and, after a resume, on 4 (odb.batching.config.gas_for_tokens; the
trainer derives it, odb/training/run/assemble.py). The oracle is the plans themselves: each step's real
tokens over all ranks, every sample exactly once across the change."""

from collections import Counter

import numpy as np
import pytest

from conftest import check_aligned, roundtrip, run_to_state
from odb.batching.batcher import OnlineBatcher
from odb.batching.config import OdbConfig, gas_for_tokens
from odb.batching.redeal import redeal_states
from odb.batching.simulate import SimulatedFeed, run_ranks

MAX_TOKENS, TARGET = 1024, 16384
LENGTHS = [(int(n), 0) for n in np.random.default_rng(6).lognormal(5.0, 0.9, 3000).clip(16, MAX_TOKENS)]


def config(ranks: int) -> OdbConfig:
    gas = gas_for_tokens(TARGET, ranks, MAX_TOKENS, 0.99)
    return OdbConfig(max_tokens=MAX_TOKENS, window=64, lookahead=16, gas=gas, global_batch_tokens=TARGET,
                     cost_model="manual")


def step_tokens(steps: list) -> list[int]:
    return [sum(map(sum, step.rank_tokens)) for step in steps[0]]


def test_gas_is_the_nearest_to_the_tokens_wanted():
    assert [gas_for_tokens(TARGET, ranks, MAX_TOKENS, 0.99) for ranks in (1, 2, 4, 8, 16, 32)] == [16, 8, 4, 2, 1, 1]
    assert gas_for_tokens(10_000, 3, 1000, 0.9) == 4  # 10000 / 2700 = 3.7
    with pytest.raises(ValueError, match="--global_batch_tokens must be"):
        OdbConfig(global_batch_tokens=0)


def test_the_trainer_derives_gas_for_packed_rows_of_odbs_policy_only():
    from odb.training.run.assemble import _gas_from_tokens

    said = []
    derived = _gas_from_tokens(OdbConfig(max_tokens=MAX_TOKENS, global_batch_tokens=TARGET), 4, said.append)
    assert derived.gas == 4 and "global_batch_tokens 16384: gas 4 on 4 rank(s)" in said[0]
    with pytest.raises(ValueError, match="policy 'fixed' pads its batches: set --gas instead"):
        _gas_from_tokens(OdbConfig(max_tokens=MAX_TOKENS, global_batch_tokens=TARGET, policy="fixed"), 4, said.append)
    with pytest.raises(ValueError, match="this model trains padded rows"):
        _gas_from_tokens(OdbConfig(max_tokens=MAX_TOKENS, global_batch_tokens=TARGET), 4, said.append, packed=False)
    with pytest.raises(ValueError, match="needs gas 16 on 1 rank.*more than --window 8"):
        _gas_from_tokens(OdbConfig(max_tokens=MAX_TOKENS, global_batch_tokens=TARGET, window=8), 1, said.append)


def test_a_resume_on_twice_the_ranks_keeps_the_tokens_per_step_and_trains_every_sample_once():
    def make(ranks):
        return lambda comm: OnlineBatcher(config(ranks), comm, dataset_size=len(LENGTHS), feed=SimulatedFeed(LENGTHS))

    head, states = run_to_state(make(2), 2, stop_after=20)
    dealt = redeal_states(states, 4)

    def resumed(comm):
        batcher = make(4)(comm)
        batcher.load_state_dict(roundtrip(dealt[comm.rank]))  # (gas 8 -> 4: resumable with global_batch_tokens)
        return list(batcher)

    tail = run_ranks(4, resumed)
    check_aligned(tail)
    trained = Counter(u for rank in head + tail for s in rank for m in s.micro_batches for u in m.uids)
    assert trained == Counter(range(len(LENGTHS)))
    before, after = step_tokens(head), step_tokens(tail)[:-2]  # (the epoch's last steps: what is left)
    print(f"tokens per step: 2 ranks x gas 8 mean {np.mean(before):.0f}, 4 ranks x gas 4 mean {np.mean(after):.0f} "
          f"(wanted {TARGET})")
    for tokens in (before, after):
        assert abs(np.mean(tokens) - TARGET) <= 0.05 * TARGET
    assert {len(s.micro_batches) for s in head[0]} == {8} and {len(s.micro_batches) for s in tail[0]} == {4}


def test_without_global_batch_tokens_a_resume_with_another_gas_is_refused():
    plain = OdbConfig(max_tokens=MAX_TOKENS, window=64, gas=8, cost_model="manual")

    def make(cfg):
        return lambda comm: OnlineBatcher(cfg, comm, dataset_size=len(LENGTHS), feed=SimulatedFeed(LENGTHS))

    _, states = run_to_state(make(plain), 2, stop_after=2)
    other = OdbConfig(max_tokens=MAX_TOKENS, window=64, gas=4, cost_model="manual")

    def resumed(comm):
        make(other)(comm).load_state_dict(roundtrip(states[comm.rank]))

    with pytest.raises(ValueError, match=r"odb settings differ from the checkpoint in \['gas'\]"):
        run_ranks(2, resumed)
