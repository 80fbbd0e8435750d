"""NumPy integers are integers: wherever detctx takes an int, ``np.int64(2)`` works too;
tensors and arrays are not integers, even holding one."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx


@pytest.mark.parametrize("level", [np.int64(2), np.int32(2), np.uint8(2)], ids=repr)
def test_a_numpy_integer_npu_level_is_taken_as_that_level(
    level: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="detctx"):
        with detctx.deterministic(seed=np.int64(1), npu_level=level) as seeding:  # type: ignore[arg-type]
            assert torch.are_deterministic_algorithms_enabled()
    detctx.seed_all(1, npu_level=level)  # type: ignore[arg-type]

    assert "npu_level=2 (no NPU: not applied)" in seeding.switches


@pytest.mark.parametrize(
    ("level", "error"),
    [(np.bool_(True), TypeError), (np.float64(2.0), TypeError), (np.int64(4), ValueError)],
    ids=repr,
)
def test_numpy_values_that_are_not_a_level_are_still_refused(level: object, error: type) -> None:
    with pytest.raises(error, match="npu_level must be None, 1, 2 or 3"):
        detctx.deterministic(seed=1, npu_level=level)  # type: ignore[arg-type]


def test_check_reproducible_takes_a_numpy_count_of_runs() -> None:
    calls: list[torch.Tensor] = []

    def train() -> torch.Tensor:
        calls.append(torch.rand(3))
        return calls[-1]

    detctx.check_reproducible(train, runs=np.int64(3))  # type: ignore[arg-type]

    assert len(calls) == 3


def test_distributed_arguments_take_numpy_numbers() -> None:
    from detctx.distributed import agree_seed, distributed_deterministic

    block = distributed_deterministic(seed=1, src=np.int64(0), timeout=np.float32(2.5))  # type: ignore[arg-type]
    with block:
        pass

    assert agree_seed(np.int64(5), src=np.int64(0), timeout=np.int64(3)) == 5  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout"):
        distributed_deterministic(seed=1, timeout=np.bool_(True))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src"):
        distributed_deterministic(seed=1, src=np.float64(0.0))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "seed",
    [torch.tensor(3), torch.tensor([3]), torch.tensor(True), np.array(3)],
    ids=["0-d tensor", "1-element tensor", "bool tensor", "0-d array"],
)
def test_a_tensor_or_array_seed_is_refused_before_anything_changes(seed: object) -> None:
    # A tensor converts to an index when it holds one integer, so tensor([3]) and
    # tensor(True) were once taken as 3 and 1 without a word: none is a seed.
    before = detctx.fingerprint()

    with pytest.raises(TypeError, match=r"seed must be a Python or NumPy integer.*\.item\(\)"):
        detctx.deterministic(seed=seed)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be a Python or NumPy integer"):
        detctx.seed_all(seed)  # type: ignore[arg-type]

    assert detctx.fingerprint() == before
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_tensor_npu_level_is_refused_like_any_other_non_integer() -> None:
    with pytest.raises(TypeError, match="npu_level must be None, 1, 2 or 3"):
        detctx.deterministic(seed=1, npu_level=torch.tensor(2))  # type: ignore[arg-type]


@given(
    value=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.bool]),
    shape=st.sampled_from([(), (1,), (1, 1)]),
)
@settings(max_examples=40, deadline=None)
def test_no_tensor_is_taken_for_a_seed_whatever_it_holds(
    value: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    seed = torch.full(shape, value).to(dtype)
    before = detctx.fingerprint()

    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        detctx.seed_all(seed)  # type: ignore[arg-type]

    assert detctx.fingerprint() == before
