"""``deterministic_region``: a part of a model whose forward *and* backward are deterministic.

``with detctx.deterministic(): y = part(x)`` switches deterministic algorithms
off again at the block's exit, so ``part``'s backward, run later by
``loss.backward()``, is not covered. A region puts identity autograd functions
at the part's boundary instead, which switch the flag during the backward pass
too. torch_npu's ``enable_deterministic_with_backward`` does the same on NPU but
forces the flag off at the boundary; a region restores what was there, on every
device type.

How the backward pass is covered
--------------------------------
Each call of a region makes two boundary nodes: an *entry* node, made before
the part runs, and an *exit* node on the part's outputs, made after it. The
exit node takes the entry node's output as an extra input, so the entry node
runs in every backward pass that reaches the exit node, on the same device
thread as the part's nodes (it is made on the device of the part's first
tensor argument, or its module's parameters). The autograd engine
runs ready nodes in reverse creation order, so in backward the exit node runs
before every node of the part, and the entry node after all of them
(``torch/csrc/autograd/engine.cpp``, ``CompareNodeTaskTime``: reproduce with a
custom ``autograd.Function`` recording the order of its backward calls). The
exit node saves the caller's flags and switches the region's on; the entry
node puts the saved flags back. A backward pass that stops inside the part
(``torch.autograd.grad`` of an intermediate) puts them back at its end, through
the engine's end-of-pass callback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union, overload

import torch
from torch import nn

from detctx._basics import nested
from detctx._switches import ALGORITHMS, Override

__all__ = ["DeterministicRegion", "deterministic_region"]

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=nn.Module)
Setting = Union[bool, Literal["warn"]]


# Every region running in the process, forward or backward, holds the flag through the
# algorithms switch's one stack of overrides, which blocks and generator worlds push and
# pop too. Regions run in several threads at once (and a forward in one thread while a
# backward runs on an autograd device thread); each saving and putting back on its own
# left the flag on whenever two of them overlapped (17 of 20 rounds of 4 threads x 50
# forward+backward calls), and so did a region overlapping a block in another thread.


def _begin(setting: Setting) -> Override:
    """Switch deterministic algorithms on as ``setting`` asks, until :func:`_end`."""
    return ALGORITHMS.override(setting)


def _end(hold: Override) -> None:
    ALGORITHMS.end_override(hold)


def _end_of_pass(callback: Callable[[], None]) -> None:
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is not None:
        queue(callback)


class _Crossing:
    """One call of a region: the hold taken while its backward runs."""

    __slots__ = ("hold", "setting")

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.hold: Override | None = None

    def enter_backward(self) -> None:
        if self.hold is None:
            self.hold = _begin(self.setting)
            _end_of_pass(_PassEnd(self))

    def leave_backward(self) -> None:
        hold, self.hold = self.hold, None
        if hold is not None:
            _end(hold)


class _PassEnd:
    """Called by the autograd engine when a backward pass completes; dropped when it fails.

    The engine runs its end-of-pass callbacks only after a pass that
    completes. When a node raises (a custom ``autograd.Function``'s backward,
    a tensor hook), the pass stops, the region's entry node never runs and
    neither does the callback; the engine drops it with the pass
    (``GraphTask``'s ``final_callbacks_``): on the CPU before the exception
    reaches the caller, on a device's autograd thread when that thread lets
    go of the pass. Putting the flags back on that drop covers a failed
    pass; before, this printed True::

        python -c "import torch, detctx
        def part(t): t = t * 2; t.register_hook(lambda g: 1 / 0); return t
        x = torch.ones(2, requires_grad=True)
        try: detctx.deterministic_region(part)(x).sum().backward()
        except ZeroDivisionError: pass
        print(torch.are_deterministic_algorithms_enabled())"
    """

    __slots__ = ("crossing",)

    def __init__(self, crossing: _Crossing) -> None:
        self.crossing = crossing

    def __call__(self) -> None:
        self.crossing.leave_backward()

    def __del__(self) -> None:
        self.crossing.leave_backward()


class _Entry(torch.autograd.Function):
    """Made before the part runs; its backward runs after all of the part's."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, crossing: _Crossing) -> torch.Tensor:
        ctx.crossing = crossing
        ctx.set_materialize_grads(False)
        return anchor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None]:
        ctx.crossing.leave_backward()
        return None, None


class _Exit(torch.autograd.Function):
    """Identity on the part's outputs; its backward runs before all of the part's."""

    @staticmethod
    def forward(
        ctx: Any, crossing: _Crossing, token: torch.Tensor, *outputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.crossing = crossing
        ctx.token_device = token.device
        ctx.set_materialize_grads(False)
        # Aliases, not the inputs themselves: autograd forbids in-place ops (a ReLU with
        # inplace=True after the region) on an input a Function returns as-is, e.g.
        # `y = Identity.apply(x); y.relu_()` raises "Output 0 of ... is a view".
        return tuple(output.detach() for output in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.crossing.enter_backward()
        # A defined gradient for the token, on its device: the engine runs a node on the
        # thread of the device its gradients are on (CPU when they are all None), and the
        # entry node must share the part's device thread to run after the part's nodes.
        return (None, torch.zeros((), device=ctx.token_device), *grads)


def _tensors(value: Any, found: list[torch.Tensor], *, grad_only: bool = True) -> None:
    for leaf in nested.leaves(value):
        if isinstance(leaf, torch.Tensor) and (leaf.requires_grad or not grad_only):
            found.append(leaf)


def _replace(value: Any, new: dict[int, torch.Tensor]) -> Any:
    # Containers keep their own type (HF's ModelOutput, a namedtuple, a dataclass).
    return nested.map_leaves(
        lambda leaf: new.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf, value
    )


def _device_of(function: Callable[..., Any], args: Any, kwargs: Any) -> torch.device:
    """Where the part computes: its first tensor argument's device, else its module's."""
    found: list[torch.Tensor] = []
    _tensors((args, kwargs), found, grad_only=False)
    if found:
        return found[0].device
    if isinstance(function, nn.Module):
        for parameter in function.parameters():
            return parameter.device
        for buffer in function.buffers():
            return buffer.device
    return torch.device("cpu")


def _run(function: Callable[..., Any], setting: Setting, args: Any, kwargs: Any) -> Any:
    tracked = torch.is_grad_enabled()
    if tracked:
        crossing = _Crossing(setting)
        anchor = torch.zeros((), device=_device_of(function, args, kwargs), requires_grad=True)
        token = _Entry.apply(anchor, crossing)  # type: ignore[no-untyped-call]
    hold = _begin(setting)
    try:
        result = function(*args, **kwargs)
    finally:
        _end(hold)
    if not tracked:
        return result
    outputs: list[torch.Tensor] = []
    _tensors(result, outputs)
    if not outputs:
        return result
    unique = list({id(tensor): tensor for tensor in outputs}.values())
    wrapped = _Exit.apply(crossing, token, *unique)  # type: ignore[no-untyped-call]
    return _replace(result, {id(old): new for old, new in zip(unique, wrapped)})


def _check(target: object, algorithms: object) -> None:
    if algorithms is not True and algorithms != "warn":
        raise ValueError(
            f"deterministic_region's algorithms must be True or 'warn', got {algorithms!r}; "
            "to run a part with determinism off, call it outside the region"
        )
    if not callable(target):
        raise TypeError(
            f"deterministic_region takes an nn.Module or a function, got {type(target).__name__}"
        )
    if inspect.isgeneratorfunction(target) or inspect.iscoroutinefunction(target):
        raise TypeError(
            "deterministic_region wraps modules and plain functions, not generator or "
            "coroutine functions: wrap the function that computes on tensors instead"
        )


class DeterministicRegion(nn.Module):
    """An ``nn.Module`` whose forward and backward run with deterministic algorithms on.

    Returned by :func:`deterministic_region` for a module. The wrapped module
    is ``.module`` (so ``state_dict`` keys gain a ``module.`` prefix, as with
    ``DistributedDataParallel``); other attributes are looked up on it.
    """

    def __init__(self, module: nn.Module, algorithms: Setting = True) -> None:
        _check(module, algorithms)
        super().__init__()
        self.module = module
        self.algorithms: Setting = algorithms

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self.module, self.algorithms, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def extra_repr(self) -> str:
        return f"algorithms={self.algorithms!r}"


@overload
def deterministic_region(
    module_or_function: M, algorithms: Setting = True
) -> DeterministicRegion: ...
@overload
def deterministic_region(module_or_function: F, algorithms: Setting = True) -> F: ...
def deterministic_region(module_or_function: Any, algorithms: Setting = True) -> Any:
    """Run a part of a model with deterministic algorithms on, in forward *and* backward.

    Returns a :class:`DeterministicRegion` for an ``nn.Module`` and a function
    for a function. Its forward runs with ``torch.use_deterministic_algorithms``
    on (``algorithms="warn"``: ``warn_only=True``). Its backward, wherever and
    whenever ``.backward()`` is called, runs the part's ops with it on and every
    other op with the caller's setting; after the backward pass the flag is what
    it was. Nothing is seeded: a region is about algorithms, not RNGs. Regions
    nest, can be called many times per forward, and work under
    ``torch.utils.checkpoint``::

        model.head = detctx.deterministic_region(model.head)
        loss = model(x).sum()
        loss.backward()          # the head's backward is deterministic, the rest as before

    Covered: tensors that require grad among the outputs, also inside tuples,
    lists and dicts. A backward pass that raises inside the region puts the
    flag back as one that completes does. The flag is process-wide: while
    any region runs in any thread (forward, or backward inside it), every
    thread sees it on, with the setting of the latest region still running;
    when the last one ends it is the setting from before the first, and a
    change another thread made meanwhile is undone. On Ascend NPUs, whose
    deterministic state is taken once per thread, switching it inside a pass
    is best-effort (see the ``algorithms`` switch).
    """
    _check(module_or_function, algorithms)
    if isinstance(module_or_function, nn.Module):
        return DeterministicRegion(module_or_function, algorithms)
    function = module_or_function

    @functools.wraps(function)
    def region(*args: Any, **kwargs: Any) -> Any:
        return _run(function, algorithms, args, kwargs)

    return region
