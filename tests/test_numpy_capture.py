"""A block reads NumPy's legacy state without ``get_state`` (45 us of its ~100): the same
tuple, Gaussian cache included, or ``get_state`` itself where that cannot be shown."""

from __future__ import annotations

import numpy as np
import pytest

from detctx._sources.numpy_restore import capture_random_state


@pytest.mark.parametrize("draws", [0, 1, 2, 3, 624, 625, 1001])
@pytest.mark.parametrize("gaussians", [0, 1, 2, 5])
def test_a_captured_state_is_get_states_tuple_cache_and_all(draws: int, gaussians: int):
    rng = np.random.RandomState(draws * 7 + gaussians)
    rng.random_sample(draws)
    rng.standard_normal(gaussians)  # an odd count leaves a Gaussian cached

    captured, expected = capture_random_state(rng), rng.get_state()

    assert captured[0] == expected[0] and captured[2:] == expected[2:]
    assert captured[1].dtype == expected[1].dtype and np.array_equal(captured[1], expected[1])
    assert captured[3] == gaussians % 2
    for value, other in zip(captured, expected):
        assert type(value) is type(other)


def test_a_captured_state_restores_the_same_draws_and_is_a_copy():
    rng = np.random.RandomState(5)
    rng.standard_normal(3)
    captured = capture_random_state(rng)
    expected = rng.standard_normal(4)

    rng.set_state(captured)

    assert np.array_equal(rng.standard_normal(4), expected)  # the cached Gaussian first


def test_a_subclass_is_read_by_get_state():
    class Mine(np.random.RandomState):
        pass

    mine = Mine(3)
    mine.standard_normal(1)

    captured = capture_random_state(mine)

    assert captured[2:] == mine.get_state()[2:] and captured[3] == 1
