"""The fast NumPy restore is indistinguishable from ``set_state``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detctx._sources.numpy_restore import restore_random_state


def sample_every_kind(rng: np.random.RandomState) -> list[np.ndarray]:
    """Samples through each path of the legacy state: Gaussian (and its cache), uniform,
    integers, binomial, gamma."""
    return [
        rng.standard_normal(3),
        rng.random_sample(3),
        rng.randint(0, 1000, 3),
        rng.binomial(10, 0.3, 3),
        rng.normal(size=1),
        rng.standard_gamma(2.0, 2),
    ]


def same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    uniforms=st.integers(0, 1500),
    normals=st.integers(0, 5),
    elsewhere=st.integers(0, 2**32 - 1),
    elsewhere_normals=st.integers(0, 3),
)
def test_fast_restore_equals_set_state(
    seed: int, uniforms: int, normals: int, elsewhere: int, elsewhere_normals: int
) -> None:
    source = np.random.RandomState(seed)
    source.random_sample(uniforms)
    source.standard_normal(normals)  # an odd count leaves a cached Gaussian
    saved = source.get_state()

    fast, slow = np.random.RandomState(elsewhere), np.random.RandomState(elsewhere)
    fast.standard_normal(elsewhere_normals)  # the target had a Gaussian cached, or not
    slow.standard_normal(elsewhere_normals)
    restore_random_state(fast, saved)
    slow.set_state(saved)

    assert same_state(fast.get_state(), slow.get_state())
    assert all(
        np.array_equal(a, b) for a, b in zip(sample_every_kind(fast), sample_every_kind(slow))
    )


def test_the_global_generator_round_trips_through_a_block() -> None:
    import detctx

    np.random.seed(3)
    np.random.standard_normal(1)  # cached Gaussian: the slow path
    with detctx.deterministic(seed=0):
        np.random.rand(5)
    after_cached = np.random.standard_normal(2)
    np.random.seed(3)
    np.random.standard_normal(1)
    assert np.array_equal(after_cached, np.random.standard_normal(2))

    np.random.seed(4)  # no cached Gaussian: the fast path
    with detctx.deterministic(seed=0):
        np.random.rand(5)
    after = np.random.rand(3)
    np.random.seed(4)
    assert np.array_equal(after, np.random.rand(3))
