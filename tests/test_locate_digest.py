"""The op digest: any one-bit change to any element changes it, for every dtype family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detctx._locate.digest import digest

WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}

SAMPLES = {
    torch.float32: torch.randn(5, 7, generator=torch.Generator().manual_seed(1)),
    torch.float64: torch.randn(33, generator=torch.Generator().manual_seed(2)).double(),
    torch.float16: torch.randn(4, 9, generator=torch.Generator().manual_seed(3)).half(),
    torch.bfloat16: torch.randn(4, 9, generator=torch.Generator().manual_seed(4)).bfloat16(),
    torch.int64: torch.arange(-20, 20),
    torch.int32: torch.arange(40, dtype=torch.int32),
    torch.int8: torch.arange(-60, 60, 3, dtype=torch.int8),
    torch.uint8: torch.arange(0, 250, 5, dtype=torch.uint8),
    torch.bool: torch.arange(30) % 3 == 0,
    torch.complex64: torch.randn(
        12, dtype=torch.complex64, generator=torch.Generator().manual_seed(5)
    ),
    torch.complex128: torch.randn(
        6, dtype=torch.complex128, generator=torch.Generator().manual_seed(6)
    ),
}


def one_ulp_up(tensor: torch.Tensor, position: int) -> torch.Tensor:
    """A copy whose element at flat ``position`` moved by one unit in the last place.

    For floats (the real part of complex numbers) that is the next representable
    value away from zero: the bit pattern plus one. For integers it is the lowest
    bit flipped, for bools the value negated.
    """
    changed = tensor.clone().reshape(-1)
    if tensor.dtype == torch.bool:
        changed[position] = ~changed[position]
        return changed.reshape(tensor.shape)
    words = changed.view(WORDS[tensor.element_size()])
    word = position * 2 if tensor.element_size() == 16 else position
    words[word] = (
        words[word] ^ 1
        if not tensor.is_floating_point() and not tensor.is_complex()
        else words[word] + 1
    )
    return changed.reshape(tensor.shape)


@pytest.mark.parametrize("dtype", list(SAMPLES), ids=str)
def test_moving_any_one_element_by_one_ulp_changes_the_digest(dtype: torch.dtype):
    tensor = SAMPLES[dtype]
    reference = digest(tensor)
    assert reference is not None
    for position in range(tensor.numel()):
        changed = one_ulp_up(tensor, position)
        assert not torch.equal(changed, tensor) or tensor.is_floating_point()
        assert digest(changed) != reference, (dtype, position)


@pytest.mark.parametrize("dtype", list(SAMPLES), ids=str)
def test_the_numpy_and_torch_paths_give_the_same_digest(dtype: torch.dtype):
    tensor = SAMPLES[dtype]
    assert digest(tensor, on_host=True) == digest(tensor, on_host=False)


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64),
    position=st.integers(0, 63),
    bit=st.integers(0, 63),
    on_host=st.booleans(),
)
def test_flipping_any_one_bit_of_any_word_changes_the_digest(
    words: list[int], position: int, bit: int, on_host: bool
):
    position %= len(words)
    tensor = torch.from_numpy(np.array(words, dtype=np.uint64).view(np.int64))
    flipped = np.array(words, dtype=np.uint64)
    flipped[position] ^= np.uint64(1 << bit)
    other = torch.from_numpy(flipped.view(np.int64))
    assert digest(tensor, on_host=on_host) != digest(other, on_host=on_host)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, width=32), min_size=2, max_size=40))
def test_equal_bits_give_equal_digests_and_a_swap_of_different_elements_does_not(
    values: list[float],
):
    tensor = torch.tensor(values, dtype=torch.float32)
    assert digest(tensor) == digest(tensor.clone())
    swapped = tensor.clone()
    swapped[[0, 1]] = tensor[[1, 0]]
    same_bits = torch.equal(tensor.view(torch.int32)[:2], tensor.view(torch.int32)[:2].flip(0))
    assert (digest(swapped) == digest(tensor)) == same_bits


def test_negative_zero_and_nan_payloads_count_as_different_bits():
    assert digest(torch.tensor([0.0])) != digest(torch.tensor([-0.0]))
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    other = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert digest(quiet) != digest(other)


def test_a_view_is_digested_in_its_logical_order():
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert digest(matrix.t()) == digest(matrix.t().contiguous())
    assert digest(matrix.t()) != digest(matrix)
    assert digest(matrix[:, 1]) == digest(torch.tensor([1.0, 5.0, 9.0]))


def test_an_empty_tensor_has_a_digest_and_a_sparse_one_has_none():
    assert digest(torch.zeros(0)) == 0
    assert digest(torch.eye(3).to_sparse()) is None
    assert digest(torch.zeros(2, device="meta")) is None


def test_a_large_tensor_beyond_the_cached_multipliers_is_digested_on_both_paths():
    tensor = torch.arange((1 << 20) + 7, dtype=torch.int32)
    assert digest(tensor, on_host=True) == digest(tensor, on_host=False)
    tensor[-1] += 1
    assert digest(tensor) != digest(torch.arange((1 << 20) + 7, dtype=torch.int32))


def test_structured_changes_in_neighbours_do_not_cancel():
    base = torch.arange(100, 164, dtype=torch.int64)
    for start in range(0, 60):
        changed = base.clone()
        changed[start : start + 3] += torch.tensor([1, -2, 1])
        assert digest(changed) != digest(base), start
        shifted = base.clone()
        shifted[start : start + 2] += torch.tensor([1, -1])
        assert digest(shifted) != digest(base), start
