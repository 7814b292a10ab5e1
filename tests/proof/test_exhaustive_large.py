"""The rest of the finite proof (tests/exhaustive.py; the smallest instances are
tests/sim/test_exhaustive.py): every static instance of 5-6 samples on 2 ranks and 4 on 3 ranks,
every dynamic one of 5-6 samples. Thousands of simulations (about 2 minutes): the full suite runs
them, the loop while coding does not."""

import pytest

from exhaustive import CONFIGS, check_dynamic, check_static


@pytest.mark.parametrize("world,sizes", [(2, range(5, 6)), (3, range(4, 5))])
@pytest.mark.parametrize("window,gas", CONFIGS)
def test_every_static_instance(world, sizes, window, gas):
    assert check_static(world, sizes, window, gas) == sum((2 * world) ** n for n in sizes)


@pytest.mark.parametrize("window,gas", [(1, 1), (3, 2)])
def test_every_static_instance_of_six_samples_on_two_ranks(window, gas):
    """The 4096 six-sample instances once per GAS, at the extreme windows."""
    assert check_static(2, range(6, 7), window, gas) == 4096


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("window,gas", CONFIGS)
@pytest.mark.parametrize("lookahead", [0, 2])
def test_every_dynamic_instance(world, window, gas, lookahead):
    assert check_dynamic(world, range(5, 7), window, gas, lookahead) == 32 + 64
