"""The smallest instances of the finite proof (tests/exhaustive.py), in the loop while coding:
every static instance of up to 4 samples on 2 ranks and 3 samples on 3 ranks, every dynamic one
of up to 4 samples. The larger ones (up to 6 samples, about 90 s) are
tests/proof/test_exhaustive_large.py."""

import pytest

from exhaustive import CONFIGS, check_dynamic, check_static

SIZES = {2: range(5), 3: range(4)}  # samples per instance, by world size


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("window,gas", CONFIGS)
def test_every_small_static_instance(world, window, gas):
    assert check_static(world, SIZES[world], window, gas) == sum((2 * world) ** n for n in SIZES[world])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("window,gas", CONFIGS)
@pytest.mark.parametrize("lookahead", [0, 2])
def test_every_small_dynamic_instance(world, window, gas, lookahead):
    assert check_dynamic(world, range(5), window, gas, lookahead) == 31
