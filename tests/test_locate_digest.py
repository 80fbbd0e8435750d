"""The op digest: any one-bit change to any element changes it, for every dtype family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detctx._locate.digest import ROW_BYTES, SMALL, STAGED, SUMMED, digest, whole_rows_digest
from detctx._locate.staging import Staging

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
    assert digest(torch.zeros(0)) is not None
    assert digest(torch.zeros(0)) != digest(torch.zeros(0, 3))
    assert digest(torch.eye(3).to_sparse()) is None
    assert digest(torch.zeros(2, device="meta")) is None


def test_the_same_bytes_under_another_shape_or_dtype_get_another_digest():
    values = torch.arange(24, dtype=torch.int32)
    assert digest(values) != digest(values.reshape(4, 6))
    assert digest(values.reshape(4, 6)) != digest(values.reshape(6, 4))
    assert digest(values) != digest(values.view(torch.float32))
    assert digest(values) != digest(values.view(torch.int16))


def test_a_large_tensor_is_reduced_on_both_paths_alike_and_any_one_change_shows():
    tensor = torch.arange(SMALL + 4097, dtype=torch.int32)  # reduced once, with a padded row
    reference = digest(tensor, on_host=True)
    assert reference == digest(tensor, on_host=False)
    for position in (0, 4095, SMALL // 3, tensor.numel() - 1):
        changed = tensor.clone()
        changed[position] ^= 1 << 31
        assert digest(changed) != reference, position


def test_sign_flips_of_two_float64_elements_change_the_digest():
    # The top bit of a 64-bit word: invisible to one sum modulo 2**64, seen by the
    # byte-reversed one.
    values = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0], dtype=torch.float64)
    for i, j in [(0, 1), (1, 3), (0, 4)]:
        flipped = values.clone()
        flipped[[i, j]] = -flipped[[i, j]]
        assert digest(flipped) != digest(values), (i, j)
    big = torch.randn(1 << 15, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    flipped = big.clone()
    flipped[[10, 20_000]] = -flipped[[10, 20_000]]
    assert digest(flipped) != digest(big)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any dtype family and shape, sometimes a non-contiguous view of a bigger one."""
    dtype = draw(
        st.sampled_from(
            [
                torch.float32,
                torch.float64,
                torch.float16,
                torch.bfloat16,
                torch.int64,
                torch.int32,
                torch.int8,
                torch.uint8,
                torch.bool,
                torch.complex64,
            ]
        )
    )
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**32 - 1))
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    words = torch.randint(-(2**62), 2**62, (numel,), generator=generator)
    tensor = words.view(torch.uint8)[: numel * torch.empty(0, dtype=dtype).element_size()]
    if dtype == torch.bool:
        tensor = tensor & 1  # a bool's byte is 0 or 1; torch's copies normalise any other
    tensor = tensor.view(dtype).reshape(shape)
    view = draw(st.sampled_from(["plain", "transposed", "strided"]))
    if view == "transposed" and len(shape) >= 2:
        tensor = tensor.transpose(0, -1)
    elif view == "strided":
        # Every other element of a tensor twice as wide: the values above, strided.
        wide = torch.stack([tensor, tensor.flip(-1)], dim=-1).reshape(*shape[:-1], -1)
        tensor = wide[..., ::2]
    return tensor


@settings(max_examples=150, deadline=None)
@given(tensor=tensors(), data=st.data())
def test_any_flipped_bit_of_any_element_of_any_view_changes_the_digest(
    tensor: torch.Tensor, data: st.DataObject
):
    reference = digest(tensor)
    packed = tensor.clone(memory_format=torch.contiguous_format)
    assert reference == digest(packed) == digest(tensor, on_host=False)
    bits = packed.reshape(-1).view(torch.uint8)
    position = data.draw(st.integers(0, bits.numel() - 1))
    bits[position] ^= 1 << data.draw(st.integers(0, 7))
    flipped = bits.view(tensor.dtype).reshape(tensor.shape)
    assert digest(flipped) != reference


@settings(max_examples=150, deadline=None)
@given(tensor=tensors(), data=st.data())
def test_a_permutation_that_moves_different_elements_changes_the_digest(
    tensor: torch.Tensor, data: st.DataObject
):
    flat = tensor.reshape(-1)
    order = data.draw(st.permutations(range(flat.numel())))
    permuted = flat[list(order)].reshape(tensor.shape)
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat = flat.clone(memory_format=torch.contiguous_format)
    same_bits = torch.equal(flat.view(word), permuted.reshape(-1).view(word))
    assert (digest(permuted) == digest(tensor)) == same_bits


def test_structured_changes_in_neighbours_do_not_cancel():
    base = torch.arange(100, 164, dtype=torch.int64)
    for start in range(0, 60):
        changed = base.clone()
        changed[start : start + 3] += torch.tensor([1, -2, 1])
        assert digest(changed) != digest(base), start
        shifted = base.clone()
        shifted[start : start + 2] += torch.tensor([1, -1])
        assert digest(shifted) != digest(base), start


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_is_digested_on_its_device_to_the_same_digest_as_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
):
    copies: list[int] = []
    real_copy = torch.Tensor.cpu

    def counting_copy(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copies.append(self.numel() * self.element_size())
        return real_copy(self, *args, **kwargs)  # type: ignore[arg-type]

    generator = torch.Generator().manual_seed(9)
    for numel in (7, 4096, SMALL // 4 + 3, 3 * SMALL + 5):
        tensor = torch.randn(numel, generator=generator)
        on_device = tensor.cuda()
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "cpu", counting_copy)
            found = digest(on_device)
        assert found == digest(tensor)
        assert copies == [], "the device path copies only its two sums (through tolist)"
        assert digest(on_device.to(torch.float64)[::2]) == digest(tensor.double()[::2])


@st.composite
def staged_tensors(draw: st.DrawFn) -> list[torch.Tensor]:
    """Up to a dozen tensors for one Staging, some small enough to be summed directly,
    some hundreds of KiB (reduced in rows)."""
    found = []
    for _ in range(draw(st.integers(1, 12))):
        tensor = draw(tensors())
        repeat = draw(st.sampled_from([1, 1, 3, 40, 400]))
        if repeat > 1:
            tensor = tensor.repeat(repeat, *([1] * (tensor.dim() - 1)))
        if tensor.nbytes <= STAGED:
            found.append(tensor)
    return found


@settings(max_examples=80, deadline=None)
@given(staged=staged_tensors())
def test_staged_tensors_get_each_its_own_digest_and_come_back_as_they_were_added(
    staged: list[torch.Tensor],
):
    staging = Staging(capacity=STAGED * 4)
    added = []
    for tensor in staged:
        if staging.room_for([tensor]):
            assert staging.add(tensor) == len(added)
            added.append(
                (tensor, tensor.clone(memory_format=torch.contiguous_format), digest(tensor))
            )
    for tensor, _, _ in added:
        tensor.zero_()  # written after it was added: the staged bytes stay as they were
    high, low = staging.digests()
    for number, (_, copy, expected) in enumerate(added):
        assert (int(high[number]) << 64) | int(low[number]) == expected
        back = staging.tensor(number)
        assert back.dtype == copy.dtype and back.shape == copy.shape
        assert torch.equal(back.reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8))
    staging.clear()
    assert len(staging) == 0 and staging.digests()[0].size == 0


def test_a_staging_buffer_says_when_a_tensor_no_longer_fits():
    staging = Staging(capacity=STAGED)
    half = torch.zeros(STAGED // 8, dtype=torch.float32)  # half the rows
    assert staging.room_for([half, half])
    assert not staging.room_for([half, half, half])
    staging.add(half)
    staging.add(half)
    assert not staging.room_for([torch.zeros(SMALL + 1, dtype=torch.uint8)])
    assert staging.room_for([torch.zeros(SMALL, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="multiple of"):
        Staging(capacity=STAGED + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_the_whole_rows_shortcut_gives_the_digest_or_declines(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(12)
    for size in (ROW_BYTES, 3 * ROW_BYTES, 64 * ROW_BYTES, SUMMED // 32 * ROW_BYTES):
        count = size // torch.empty(0, dtype=dtype).element_size()
        tensor = torch.randint(0, 100, (count,), generator=generator).to(dtype)
        assert whole_rows_digest(tensor) == digest(tensor)
        assert whole_rows_digest(tensor.reshape(-1, 8)) == digest(tensor.reshape(-1, 8))
    assert whole_rows_digest(torch.zeros(ROW_BYTES + 4, dtype=torch.uint8)) is None
    assert whole_rows_digest(torch.zeros(64, ROW_BYTES, dtype=torch.uint8).t()) is None
    assert whole_rows_digest(torch.zeros(SMALL, dtype=torch.uint8)) is None
    assert (
        whole_rows_digest(torch.zeros(SUMMED // 32 * ROW_BYTES + ROW_BYTES, dtype=torch.uint8))
        is None
    )
    values = torch.randn(ROW_BYTES, dtype=torch.complex64, generator=generator)
    assert whole_rows_digest(values.conj()) is None


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 65, 130])
def test_the_float32_products_give_the_int8_product_exactly_at_the_extremes(
    rows: int, own: bool
) -> None:
    # Where the CPU has no int8 dot products, the reduce step multiplies in float32,
    # 1024 bytes a product: every partial sum must stay an integer float32 holds.
    from detctx._locate import products as module
    from detctx._locate.keys import PUBLIC_KEY

    weights = PUBLIC_KEY.weights(0, torch.device("cpu"))
    generator = torch.Generator().manual_seed(rows)
    extremes = [
        torch.randint(-128, 128, (rows, ROW_BYTES), dtype=torch.int8, generator=generator),
        torch.full((rows, ROW_BYTES), -128, dtype=torch.int8),
        torch.full((rows, ROW_BYTES), 127, dtype=torch.int8),
        # Each byte at the extreme of the sign of its weight in column 0: the largest sum.
        torch.where(weights[:, 0] > 0, 127, -128).to(torch.int8).repeat(rows, 1),
    ]
    for data in extremes:
        # float64 holds every such sum exactly (below 2**27): the int8 product's sums.
        exact = (data.double() @ weights.double()).to(torch.int32)
        assert torch.equal(module._float_product(data, weights, own), exact)


@pytest.mark.parametrize("floats", [True, False])
def test_a_large_tensor_has_one_digest_whichever_product_this_cpu_takes(
    floats: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from detctx._locate import products as module

    tensor = torch.randn(3, ROW_BYTES + 5, generator=torch.Generator().manual_seed(7))
    chosen = digest(tensor)
    monkeypatch.setattr(module, "_method", [floats])  # torch 2.1: no int8 product, float64
    assert digest(tensor) == chosen
    assert whole_rows_digest(tensor[:, :ROW_BYTES].contiguous()) == digest(
        tensor[:, :ROW_BYTES].contiguous()
    )


@pytest.mark.parametrize("floats", [True, False])
def test_a_large_digest_leaves_the_programs_memory_resizable_and_own_copies_agree(
    floats: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only detctx's own copies are read by NumPy in place (``own``): a tensor NumPy has
    # seen can never be resized again, and FSDP2 resizes its parameters' storage.
    from detctx._locate import products as module

    monkeypatch.setattr(module, "_method", [floats])
    generator = torch.Generator().manual_seed(11)
    for size in (STAGED + 1, 3 * ROW_BYTES // 4 + 17, 40 * ROW_BYTES):
        tensor = torch.randn(size, generator=generator)
        expected = digest(tensor)
        assert digest(tensor.clone(), own=True) == expected
        whole = whole_rows_digest(tensor)
        assert whole is None or whole == expected
        tensor.untyped_storage().resize_(0)  # raises if NumPy had seen this memory
