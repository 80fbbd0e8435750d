"""What the recorder needs to know of an ATen op, and which ops it skips.

:class:`OpInfo` reads an op's schema once: its name, whether it draws
random numbers, which arguments it writes, and whether its output carries
new values at all (views, copies, constants and uninitialised memory do
not, and are not recorded).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Final

import torch

from detctx._locate.batch import op_number

__all__ = ["INFOS", "OpInfo", "generator_state", "op_info"]


class OpInfo:
    __slots__ = ("call", "constant", "kept", "name", "number", "random", "skip", "written")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        overload = func._overloadname
        self.name = schema.name if overload == "default" else f"{schema.name}.{overload}"
        self.number = op_number(self.name)
        # The bound C++ op: calling it skips OpOverload.__call__'s Python frame.
        self.call: Callable[..., Any] = getattr(func, "_op", func)
        tags = getattr(func, "tags", ())
        seeded = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
        self.random = seeded is not None and seeded in tags
        self.written = tuple(
            (index, argument.name)
            for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        returns = schema.returns
        self.kept: int | None = _BOOKKEEPING.get(schema.name)
        self.constant = self.name in _CONSTANTS  # its output follows from its arguments
        self.skip = (
            (
                bool(returns)
                and not self.written
                and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
            )
            or schema.name in _UNCOMPUTED
            or schema.name in _ALIASES
            or schema.name in _COPIES
            or self.name in _CONSTANTS
            or schema.name.startswith("profiler::")
        )


_BOOKKEEPING: Final = {
    "aten::_scaled_dot_product_flash_attention": 2,
    "aten::_scaled_dot_product_efficient_attention": 2,
    "aten::_scaled_dot_product_cudnn_attention": 2,
    "aten::_flash_attention_forward": 2,
    "aten::_efficient_attention_forward": 2,
    "aten::mkldnn_rnn_layer": 3,
    "aten::_cudnn_rnn": 3,
    "aten::miopen_rnn": 3,
    "aten::_ctc_loss": 1,
    "aten::cudnn_batch_norm": 3,
    "aten::_batch_norm_with_update": 3,
    "aten::_batch_norm_no_update": 3,
    "fsdp::all_gather_copy_in": 1,
}
"""Ops whose outputs past the first few are bookkeeping, not values: how many carry values.

The attention kernels return their output and log-sum-exp, then sequence
lengths, dropout seeds and a debug mask that the kernel may leave as
uninitialised memory: torch 2.1's CPU flash kernel returns five 0-dim
tensors that hold other bits on every call with the same inputs
(``torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)``
three times, then ``torch.equal`` on outputs 2, 3, 6, 7, 8). The recurrent
kernels return their output and last hidden (and cell) state, then a
workspace for their backward (``nn.LSTM`` and ``nn.GRU`` on the CPU: a
uint8 tensor that holds other bits in two processes running the same);
``ctc_loss`` returns the loss and its forward variables, whose entries past
each sequence's length are left as they were in memory; cuDNN's batch norm
returns a reserve space after the output and the saved statistics. FSDP2's
``all_gather_copy_in`` returns this rank's part of the all-gather buffer,
which it filled, then the whole buffer, whose other ranks' parts are
uninitialised memory until the all-gather writes them. Only the
values are recorded; a difference in a dropout seed shows in the output it
drew, one in a workspace in the backward op that reads it.
"""


INFOS: dict[Any, OpInfo] = {}
"""What the recorder knows of each op it has seen, shared by every recorder."""


def op_info(func: Any) -> OpInfo:
    """What the recorders know of ``func``, read from its schema the first time."""
    info = INFOS.get(func)
    if info is None:
        info = INFOS[func] = OpInfo(func)
    return info


def generator_state(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    generator = kwargs.get("generator")
    if not isinstance(generator, torch.Generator):
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
        device = torch.device(device)
        if device.type == "cpu":
            generator = torch.default_generator
        else:
            module = getattr(torch, device.type, None)
            generators = getattr(module, "default_generators", ())
            if not generators:
                return 0
            index = device.index if device.index is not None else module.current_device()
            if index >= len(generators):
                return 0
            generator = generators[index]
    state = generator.get_state()
    return int.from_bytes(
        hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(), "little"
    )


_UNCOMPUTED: Final = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::resize_",
        "aten::set_",
    }
)
"""Ops that compute nothing, skipped like views: uninitialised memory, or a tensor
pointed at existing memory.

Their outputs are whatever was in memory (the op that fills them is
recorded), and a DataLoader's main process runs ``empty`` + ``set_`` for each
batch as it arrives from a worker, in arrival order, which differs from run
to run although the loader hands batches out in order. The first op that
reads such a tensor is where its values count.
"""

_ALIASES: Final = frozenset({"aten::_unsafe_view"})
"""Views whose schema does not say so, skipped like the others: the output is the
input's memory under another shape.

``_unsafe_view`` is the reshape that ``matmul`` and ``bmm``'s callers run on
every product; digesting it read each product's bytes twice (a tenth of all
bytes digested in a nanoGPT step).
"""

_COPIES: Final = frozenset({"aten::clone", "aten::select_backward", "aten::slice_backward"})
"""Ops that only move bits, skipped like views: the output holds exactly the input's
bits (``clone``) or those bits and zeros (the backward of ``select`` and ``slice``).

Given the same input they give the same bits on every device, so a difference
in their output is a difference in their input, which the op that made it
shows. A tensor from outside torch (a NumPy write into its memory) counts at
the first op that computes from it, not at a copy of it. In a nanoGPT step
they are a sixth of the bytes a step makes (``nn.MultiheadAttention``'s
backward runs a ``select_backward`` of three times the activations per layer).
"""


_CONSTANTS: Final = frozenset(
    {
        "aten::zeros",
        "aten::zeros_like",
        "aten::new_zeros",
        "aten::zero_",
        "aten::ones",
        "aten::ones_like",
        "aten::new_ones",
        "aten::full",
        "aten::full_like",
        "aten::new_full",
        "aten::fill_.Scalar",
        "aten::scalar_tensor",
        "aten::arange",
        "aten::arange.start",
        "aten::arange.start_step",
    }
)
"""Ops whose output is a constant, skipped like copies: every element follows from the
shape and the Python numbers they are given (``zeros_like``, ``fill_`` with a number,
``arange``).

They give the same bits on every device and in every run that asks for the
same, so a difference in their output is a difference in what they were
asked, which the first op that reads it shows. An optimiser's first step
runs two ``zeros_like`` for each parameter.
"""
