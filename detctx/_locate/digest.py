"""Bit-exact digests of tensors, computed where the tensor lives.

The digest is a 128-bit integer: a hash of the tensor's bytes (its elements
in logical order) XOR-ed with a hash of its dtype and shape. It is built in
two steps.

**Reduce** (a tensor of more than :data:`SMALL` bytes): the bytes, read as
signed 8-bit integers, are cut into rows of :data:`ROW_BYTES` (the last one
padded with zeros) and multiplied by a matrix of odd 8-bit weights drawn from
the key (:mod:`detctx._locate.keys`),
:data:`COLUMNS` columns, with exact 32-bit sums (``torch._int_mm``, an
integer matrix product). The result, 256 times smaller, is reduced again
until it is no more than :data:`SUMMED` bytes. A difference in the input
survives a step unless every column's weighted sum of it is ``0``: for
weights that behave like random odd numbers (128 values) that is a
probability of at most ``2**-7`` per column (fix every weight but one that
meets a non-zero difference: at most one value of that one cancels), so
``2**-56`` for the 8 columns.

**Sum** (a tensor of at most :data:`SMALL` bytes, or reduced sums of at most
:data:`SUMMED` bytes, padded to 8-byte words ``w[k]``):
``S_A = sum(w[k] * a[k])`` and ``S_B = sum(bswap(w[k]) * c[k])``, modulo
``2**64``, with ``a`` and ``c`` two streams of odd words drawn from the key
(following no pattern). A change in one word is always seen:
``S_A`` changes by a non-zero ``delta`` times an odd number, never ``0``
modulo ``2**64``. Other differences cancel in one sum with probability
about ``2**-(63 - v)``, where ``v`` is the lowest changed bit in every
word: a sum modulo ``2**64`` cannot see a difference above bit 63. The byte
reversal puts the bits that are high in ``S_A``'s words low in ``S_B``'s,
so the two lowest changed bits add up to at most 70 and both sums cancel
with probability at most about ``2**-56``. One sum alone would not do:
flipping the sign of two float64 elements (bit 63 of their words) changes
``S_A`` by ``2**63 * (a[x] + a[y])``, a multiple of ``2**64``, every time.

So: a tensor of at most :data:`SMALL` bytes that differs in one element
always gets another digest; any other difference (several elements, a
permutation, any tensor larger than that) is missed with probability below
about ``2**-54`` (at most three reduce steps and the sums, each ``2**-56``).
That is enough: a run compares some 10^3 to 10^7 ops, so a difference
missed anywhere in it has a probability below ``10^7 * 2**-54``, about
``10^-9``, and a difference that slips through one op is still seen
at the next op that reads its output.

These bounds hold for a difference that does not depend on the key: one
that arises by itself, or one crafted without knowing the key. Under the
public key (:data:`~detctx._locate.keys.PUBLIC_KEY`) a crafted one can be
solved for; under a secret key only a program that reads the key can.

Speed: the reduce step runs at about 0.06 ns per byte on one CPU core
with VNNI int8 products, the sums at about 0.15 ns per byte. A CPU without
them (AVX2 only) runs ``torch._int_mm`` at some 6 ns per byte; there the
same sums are made by float32 products of 1024 bytes at a time (each exact:
no partial sum reaches ``2**24``), about 0.4 ns per byte. Which one a
process takes is timed once, on a probe; the digests are the same. A tensor is read
once, in place; the temporaries are the reduced sums (a 256th of its size)
and at most 256 KiB of byte-reversed words, plus a contiguous copy of a
non-contiguous view. On an accelerator both steps are torch ops on the
device and only the final sums (16 bytes) are copied to the host.

A recorder digests thousands of small tensors a second, where NumPy's
per-call cost, not the bytes, is what counts:
:class:`~detctx._locate.staging.Staging` digests many at once, to the same
digests.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Final

import numpy as np
import torch

from detctx._locate.keys import COLUMNS, ROW_BYTES, WORDS, DigestKey, process_key
from detctx._locate.products import int_matmul

__all__ = [
    "COLUMNS",
    "NUMPY_DTYPES",
    "ROW_BYTES",
    "SMALL",
    "STAGED",
    "STREAM_A",
    "STREAM_C",
    "SUMMED",
    "digest",
    "host_copy",
    "int_matmul",
    "layout_code",
    "layout_halves",
    "memory_order_digest",
    "tensor_bytes",
    "whole_rows_digest",
]

SMALL: Final = 1 << 11
"""Bytes summed directly; more are reduced first (a reduce step costs less per byte than
the sums, and one product covers every staged tensor)."""
STAGED: Final = SMALL * ROW_BYTES // (4 * COLUMNS)
"""The largest tensor :class:`~detctx._locate.staging.Staging` takes (512 KiB): one
reduce step brings it to ``SMALL`` bytes."""
SUMMED: Final = 1 << 16
"""Bytes of reduced sums summed directly: a reduce step's fixed cost (some 20 us) is
more than summing this many."""
assert SUMMED // 8 == WORDS

_FEW: Final = 8
_UNPACK: Final = [(struct.Struct(f"<{n}Q"), struct.Struct(f">{n}Q")) for n in range(_FEW + 1)]
_MASK: Final = (1 << 64) - 1
STREAM_A: Final = 0
STREAM_C: Final = 1
"""Which of a key's two streams of multipliers (:meth:`DigestKey.stream`)."""

_layouts: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}
_halves: dict[tuple[torch.dtype, tuple[int, ...]], tuple[int, int]] = {}
NUMPY_DTYPES: Final = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.complex128,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
"""dtypes ``Tensor.numpy()`` reads (bfloat16 and the float8 types take the torch path)."""


def layout_code(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """A 128-bit hash of a dtype and a shape (what the digest folds in beside the bits)."""
    key = (dtype, shape)
    code = _layouts.get(key)
    if code is None:
        text = f"{dtype}|{','.join(map(str, shape))}".encode()
        code = _layouts[key] = int.from_bytes(hashlib.blake2b(text, digest_size=16).digest())
    return code


def layout_halves(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    """:func:`layout_code` as its high and low 64 bits."""
    key = (dtype, shape)
    halves = _halves.get(key)
    if halves is None:
        code = layout_code(dtype, tuple(shape))
        halves = _halves[key] = (code >> 64, code & _MASK)
    return halves


def _reduce(data: torch.Tensor, stage: int, key: DigestKey, own: bool) -> torch.Tensor:
    """One reduce step: uint8 bytes in, the product's int32 sums out as uint8 bytes.
    ``own``: ``data`` is detctx's own memory (see :func:`int_matmul`)."""
    weights = key.weights(stage, data.device)
    full, rest = divmod(data.numel(), ROW_BYTES)
    signed = data.view(torch.int8)
    if not rest:
        product = int_matmul(signed.view(full, ROW_BYTES), weights, own=own)
        return product.view(-1).view(torch.uint8)
    parts = []
    if full:
        rows = signed[: full * ROW_BYTES].view(full, ROW_BYTES)
        parts.append(int_matmul(rows, weights, own=own))
    last = signed.new_zeros(1, ROW_BYTES)
    last[0, :rest] = signed[full * ROW_BYTES :]
    parts.append(int_matmul(last, weights, own=True))
    product = parts[0] if len(parts) == 1 else torch.cat(parts)
    return product.reshape(-1).view(torch.uint8)


def _few_sums(raw: bytes, key: DigestKey) -> tuple[int, int]:
    """``(S_A, S_B)`` of at most ``8 * _FEW`` bytes, in Python integers (no NumPy calls)."""
    if len(raw) % 8:
        raw += bytes(8 - len(raw) % 8)
    little, big = _UNPACK[len(raw) // 8]
    a, c = key.few
    first = second = 0
    for word, swapped, m_a, m_c in zip(little.unpack(raw), big.unpack(raw), a, c):
        first += word * m_a
        second += swapped * m_c
    return first & _MASK, second & _MASK


def _host_sums(data: np.ndarray, key: DigestKey) -> tuple[int, int]:
    """``(S_A, S_B)`` of at most ``SUMMED`` bytes (a contiguous uint8 array), in NumPy."""
    size = len(data)
    if size <= _FEW * 8:
        return _few_sums(data.tobytes(), key)
    if size % 8:
        words = np.zeros(size // 8 + 1, dtype=np.uint64)
        words.view(np.uint8)[:size] = data
    else:
        words = data.view(np.uint64)
    count = len(words)
    # Unsigned 64-bit dot products wrap modulo 2**64 without a warning; astype to
    # big-endian reverses each word's bytes in one vectorised pass.
    first = np.dot(words, key.stream(STREAM_A)[:count])
    second = np.dot(words.astype(">u8").view(np.uint64), key.stream(STREAM_C)[:count])
    return int(first), int(second)


def whole_rows_digest(tensor: torch.Tensor, key: DigestKey | None = None) -> int | None:
    """:func:`digest` of a contiguous CPU tensor of whole :data:`ROW_BYTES` rows whose
    one reduce step leaves at most :data:`SUMMED` bytes, in a dozen calls; ``None`` for
    any other tensor (take :func:`digest`).

    Most large outputs of a training step are such tensors, and a recorder digests
    hundreds of them a step, where each call into torch or NumPy counts.
    """
    size = tensor.nbytes
    rows, rest = divmod(size, ROW_BYTES)
    if (
        rest
        or size <= SMALL
        or rows * 4 * COLUMNS > SUMMED
        or not tensor.is_cpu
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return None
    key = process_key() if key is None else key
    signed = tensor.detach().view(-1).view(torch.int8).view(rows, ROW_BYTES)
    product = int_matmul(signed, key.weights(0, signed.device)).numpy()
    words = product.reshape(-1).view(np.uint64)
    count = len(words)
    first = int(np.dot(words, key.stream(STREAM_A)[:count]))
    second = int(np.dot(words.byteswap(), key.stream(STREAM_C)[:count]))
    return ((first << 64) | second) ^ layout_code(tensor.dtype, tuple(tensor.shape))


def memory_order_digest(tensor: torch.Tensor, key: DigestKey | None = None) -> int | None:
    """The digest of a large, dense, permuted CPU tensor read in memory order, its strides
    folded in; ``None`` for any other tensor.

    An op's output that is a permutation of a dense block (``q * scale`` on a
    transposed ``q`` keeps ``q``'s strides) is read where it lies: a copy into
    logical order would cost more than the digest. Two runs that produce the
    same bits with the same strides agree; other strides are another layout,
    as another shape is.
    """
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.nbytes <= STAGED
    ):
        return None
    strides = tensor.stride()
    expected = 1
    for stride, size in sorted(zip(strides, tensor.shape)):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    flat = tensor.detach().as_strided((tensor.numel(),), (1,))
    bits = digest(flat, key=key)
    if bits is None:
        return None
    return bits ^ layout_code(tensor.dtype, (*tensor.shape, -1, *strides))


def _device_sums(data: torch.Tensor, key: DigestKey) -> tuple[int, int]:
    """``(S_A, S_B)`` of at most ``SUMMED`` bytes (a contiguous uint8 tensor), on its device."""
    device = data.device
    full, rest = divmod(data.numel(), 8)
    if rest or data.storage_offset() % 8:
        # A slice that starts mid-word cannot be viewed as int64 in torch.
        padded = data.new_zeros((full + (rest > 0)) * 8)
        padded[: data.numel()] = data
        data = padded
    words = data.view(torch.int64)
    swapped = data.view(-1, 8).flip(1).reshape(-1).view(torch.int64)
    count = words.numel()
    # torch has no unsigned 64-bit arithmetic before 2.3; int64 products and sums wrap
    # modulo 2**64 in two's complement, the same residues as NumPy's uint64.
    totals = torch.stack(
        (
            (words * key.torch_stream(STREAM_A, device)[:count]).sum(),
            (swapped * key.torch_stream(STREAM_C, device)[:count]).sum(),
        )
    )
    first, second = totals.tolist()  # the only copy to the host: 16 bytes
    return first & _MASK, second & _MASK


def host_copy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor of a :data:`NUMPY_DTYPES` dtype as a C-ordered NumPy array of a copy made
    by torch, its conjugate and negative bits resolved.

    NumPy never sees the tensor's own memory: in torch 2.13 ``Tensor.numpy()`` (with
    ``force=True`` too, and on any view) makes the storage non-resizable for good, and
    FSDP2, which frees each unsharded parameter with ``untyped_storage().resize_(0)``,
    then fails in its reshard ("Trying to resize storage that is not resizable";
    ``t = torch.ones(4); t.numpy(); t.untyped_storage().resize_(0)`` raises it).
    """
    values = tensor.detach() if tensor.requires_grad else tensor
    if values.dtype == torch.bool:
        # torch's copy of a bool tensor makes each non-zero byte 1; the bytes are kept.
        return host_copy(values.view(torch.uint8)).view(np.bool_)
    array = values.clone(memory_format=torch.contiguous_format).numpy(force=True)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in logical order as a 1-D uint8 tensor (a copy only if needed)."""
    flat = tensor.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    flat = flat.reshape(-1)
    if not flat.is_contiguous() or flat.stride(0) != 1:
        # A one-element view counts as contiguous whatever its stride, but only a
        # stride of 1 can be read as bytes.
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def digest(
    tensor: torch.Tensor,
    *,
    on_host: bool | None = None,
    key: DigestKey | None = None,
    own: bool = False,
) -> int | None:
    """The 128-bit digest of ``tensor``'s bits, dtype and shape, or ``None`` when unreadable.

    A non-contiguous view is read in its logical order. Sparse, quantized and
    meta tensors and tensor subclasses have no digest. ``on_host`` forces
    the final sums into NumPy (``True``, copying at most ``SUMMED`` bytes to
    the host) or into torch (``False``); by default CPU tensors use NumPy and
    others their own device. ``key``: whose constants (default: this process's
    secret key; two digests compare only under the same key). ``own``: the tensor is
    detctx's own copy, which NumPy may read in place (never the program's tensor: see
    :func:`host_copy`); the digest is the same.
    """
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return None
    if tensor.layout != torch.strided or tensor.is_quantized:
        return None
    device = tensor.device.type
    if device == "meta":
        return None
    layout = layout_code(tensor.dtype, tuple(tensor.shape))
    key = process_key() if key is None else key
    if (
        on_host is not False
        and device == "cpu"
        and tensor.dtype in NUMPY_DTYPES
        and tensor.numel() * tensor.element_size() <= SMALL
    ):
        # Most ops' outputs: a copy of at most SMALL bytes, read in NumPy.
        array = host_copy(tensor)
        if array.nbytes <= _FEW * 8:
            first, second = _few_sums(array.tobytes(), key)
        else:
            first, second = _host_sums(array.reshape(-1).view(np.uint8), key)
        return ((first << 64) | second) ^ layout
    data = tensor_bytes(tensor)
    stage, limit = 0, SMALL
    while data.numel() > limit:
        # After the first step the bytes are the product's: detctx's own.
        data = _reduce(data, stage, key, own or stage > 0)
        stage, limit = stage + 1, SUMMED
    if on_host is None:
        on_host = data.device.type == "cpu"
    if on_host:
        if not stage and data.is_cpu:
            data = data.clone()  # the tensor's own bytes (see host_copy)
        first, second = _host_sums(data.cpu().numpy(), key)
    else:
        first, second = _device_sums(data, key)
    return ((first << 64) | second) ^ layout
