"""What the recorder digests: an op's output tensors, and the result of a recorded function.

An op's outputs are the tensors it returned and those it wrote in place. A
nested tensor (``torch.nested``) has no plain shape: a strided one raises
on ``.shape`` (``NestedTensorImpl doesn't support sizes``) and a jagged
one's ragged size is a symbol numbered anew in every run (``j3`` in one,
``j7`` in the next). So a nested tensor is digested as its components
(``unbind()``, plain tensors, each with its shape) and described by the
shape of its padded form, each ragged dimension at its largest size.

A function's result is digested leaf by leaf, through the one walker over
nested values: a tensor as an op's output is, anything else by its
canonical bytes (numbers, strings, arrays). A leaf with no such form (a
module, an object) is not compared: two runs cannot be told apart by it
without guessing, and a guess could report runs that agree as parted.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final, NamedTuple

import torch

from detctx._basics import nested
from detctx._locate.digest import digest, layout_code, memory_order_digest, whole_rows_digest
from detctx._locate.ops import OpInfo
from detctx._state import canonical_bytes

__all__ = [
    "ResultLeaf",
    "combine_digests",
    "describe",
    "first_result_difference",
    "new_values",
    "outputs_digest",
    "result_leaves",
    "tensors",
    "unnested",
]

_MASK: Final = (1 << 128) - 1
_PRIME: Final = 0x0000000001000000000000000000013B
_OFFSET: Final = 0x6C62272E07BB014262B821756295C58D


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors an op returned or was given: ``value`` itself, or those in a list or tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def new_values(
    info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
) -> list[torch.Tensor]:
    """The tensors that hold an op's new values: what it returned (its first ``info.kept``
    results) and the arguments it wrote in place."""
    outputs = [result] if type(result) is torch.Tensor else tensors(result)
    if info.kept is not None:
        outputs = outputs[: info.kept]
    for index, name in info.written:
        argument = args[index] if index < len(args) else kwargs.get(name)
        outputs.extend(t for t in tensors(argument) if not any(t is o for o in outputs))
    return outputs


def unnested(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` with each nested tensor replaced by its components, in order."""
    if not any(tensor.is_nested for tensor in outputs):
        return outputs
    plain: list[torch.Tensor] = []
    for tensor in outputs:
        plain.extend(_components(tensor) if tensor.is_nested else [tensor])
    return plain


def describe(tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], torch.device]:
    """A tensor's dtype, shape and device; a nested tensor's shape is its padded form's."""
    if not tensor.is_nested:
        return tensor.dtype, tuple(tensor.shape), tensor.device
    components = [tuple(component.shape) for component in _components(tensor)]
    padded = tuple(max(sizes) for sizes in zip(*components)) if components else ()
    return tensor.dtype, (len(components), *padded), tensor.device


def _components(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A nested tensor's components; where torch cannot unbind it, its values buffer."""
    try:
        # Detached: unbinding a tensor that requires grad would build autograd nodes.
        return list(tensor.detach().unbind())
    except Exception:  # whatever torch raises here: the user's op has run, and must return
        # A jagged tensor the backward pass makes can hold its offsets on the meta
        # device: unbind() raises "Cannot copy out of meta tensor". Its values are
        # plain (and its shape is the same in every run that computes the same).
        values = getattr(tensor, "_values", None)
        return [values.detach()] if isinstance(values, torch.Tensor) else []


def outputs_digest(outputs: list[torch.Tensor]) -> int:
    """The digest of an op's plain outputs, each digested now (see :func:`combine_digests`)."""
    digests = []
    for tensor in outputs:
        bits = None
        if type(tensor) is torch.Tensor and tensor.layout == torch.strided:
            if tensor.is_contiguous():
                bits = whole_rows_digest(tensor)
            else:
                bits = memory_order_digest(tensor)
        if bits is None:
            bits = digest(tensor)
        digests.append(layout_code(tensor.dtype, tuple(tensor.shape)) if bits is None else bits)
    return combine_digests(digests)


def combine_digests(digests: list[int]) -> int:
    """One output's digest is the op's; several are chained with FNV-1a over 128-bit
    parts, each step a bijection of the running value, so a change in any one output's
    digest always changes the result."""
    if len(digests) == 1:
        return digests[0]
    value = _OFFSET
    for bits in digests:
        value = ((value ^ bits) * _PRIME) & _MASK
    return value


class ResultLeaf(NamedTuple):
    """One part of a function's result: where it is (``result["loss"]``), its digest
    (``None``: not compared) and what it is, in words; a tensor's dtype (``float32``),
    shape and device too."""

    path: str
    digest: int | None
    what: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    device: str = ""


def result_leaves(value: Any, path: str = "result") -> list[ResultLeaf]:
    """Every container and leaf of ``value``, depth first, digested (a value that holds
    itself, or is nested deeper than Python recurses, is one part not compared)."""
    try:
        return _parts(value, path)
    except RecursionError:
        return [ResultLeaf(path, None, f"a {type(value).__name__} nested too deep to compare")]


def _parts(value: Any, path: str) -> list[ResultLeaf]:
    found = nested.branches(value)
    if found is None:
        return [_leaf(value, path)]
    kind, items = found
    keys = [_key_text(key) for key, _ in items]
    shape = f"{kind.value}|{type(value).__qualname__}|{len(items)}|{'|'.join(keys)}"
    parts = [ResultLeaf(path, _text_digest(shape.encode()), f"a {type(value).__name__}")]
    for index, (key, child) in enumerate(items):
        parts.extend(_parts(child, nested.child_path(path, kind, key, index, _key_text)))
    return parts


def first_result_difference(first: list[ResultLeaf], other: list[ResultLeaf]) -> ResultLeaf | None:
    """The first part of ``other`` that differs from ``first``'s (``None`` when none does):
    another place, or another digest where both have one."""
    for a, b in zip(first, other):
        if a.path != b.path:
            return b
        if a.digest is not None and b.digest is not None and a.digest != b.digest:
            return b
    if len(first) != len(other):
        shorter = min(len(first), len(other))
        longer = first if len(first) > len(other) else other
        return longer[shorter]
    return None


def _leaf(value: Any, path: str) -> ResultLeaf:
    if isinstance(value, torch.Tensor):
        dtype, shape, device = describe(value)
        what = f"a {str(dtype).removeprefix('torch.')} tensor of shape {shape} on {device}"
        if value.is_nested:
            what = f"a nested {what[2:]} (padded)"
        # A tensor with no digest (a subclass) counts by its dtype and shape, as an op does.
        bits = outputs_digest(unnested([value])) ^ layout_code(dtype, shape)
        name = str(dtype).removeprefix("torch.")
        return ResultLeaf(path, bits, what, name, tuple(shape), str(device))
    try:
        data = canonical_bytes(value, strict=True)
    except (TypeError, ValueError):
        return ResultLeaf(path, None, f"a {type(value).__name__}")
    return ResultLeaf(path, _text_digest(data), f"a {type(value).__name__}")


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return json.dumps(key)
    if isinstance(key, (int, float, bool, bytes)) or key is None:
        return repr(key)
    # A key with no stable text (an object's repr carries its address) counts by position.
    return f"<{type(key).__name__}>"


def _text_digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")
