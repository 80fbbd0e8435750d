"""The ops ``detctx doctor --probe`` runs: ops known to be nondeterministic on some device.

Each :class:`ProbeOp` builds its inputs once (from a fixed CPU generator, then
moved to the device) and returns a thunk that runs the op and returns its
result (for a backward, the gradients). The thunk is what is run repeatedly
and compared bit for bit. Inputs are small on the CPU (the probe runs in
tests) and large on accelerators, where nondeterminism comes from atomics and
shows up with many colliding writes. Sources for "nondeterministic on some
device": the list in ``torch.use_deterministic_algorithms``'s documentation
and torch_npu's ``test_torch_deterministicalgorithms.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
import torch.nn.functional as F

__all__ = ["PROBE_OPS", "ProbeOp", "placed"]

Thunk = Callable[[], Any]


def _always(device: torch.device) -> bool:
    return True


@dataclass(frozen=True)
class ProbeOp:
    """One op of the probe: ``build(device, large)`` makes its inputs and returns a thunk
    that runs it once; ``applies(device)`` says whether it can run on ``device`` now."""

    name: str
    build: Callable[[torch.device, bool], Thunk]
    applies: Callable[[torch.device], bool] = field(default=_always)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(device: torch.device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen()).to(device)


def _index(device: torch.device, high: int, count: int) -> torch.Tensor:
    return torch.randint(0, high, (count,), generator=_gen()).to(device)


def _sizes(large: bool) -> tuple[int, int]:
    """(targets, colliding sources): many more sources than targets, so writes collide."""
    return (256, 1 << 20) if large else (16, 2048)


def _colliding(device: torch.device, large: bool) -> tuple[torch.Tensor, ...]:
    """A zero target, indices into it with many repeats, and the values to write."""
    targets, count = _sizes(large)
    return (
        torch.zeros(targets, device=device),
        _index(device, targets, count),
        _randn(device, count),
    )


def _index_add(device: torch.device, large: bool) -> Thunk:
    dst, idx, src = _colliding(device, large)
    return lambda: dst.clone().index_add_(0, idx, src)


def _scatter(reduce: str | None) -> Callable[[torch.device, bool], Thunk]:
    def build(device: torch.device, large: bool) -> Thunk:
        dst, idx, src = _colliding(device, large)
        if reduce is None:
            return lambda: dst.clone().scatter_add_(0, idx, src)
        return lambda: dst.clone().scatter_reduce_(0, idx, src, reduce=reduce)

    return build


def _index_put(device: torch.device, large: bool) -> Thunk:
    dst, idx, src = _colliding(device, large)
    return lambda: dst.clone().index_put_((idx,), src, accumulate=True)


def _grads(loss: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> Thunk:
    return lambda: torch.autograd.grad(loss(), inputs)


def _embedding(device: torch.device, large: bool) -> Thunk:
    rows, count = _sizes(large)
    weight = _randn(device, rows, 16).requires_grad_()
    idx, upstream = _index(device, rows, count), _randn(device, count, 16)
    return _grads(lambda: (F.embedding(idx, weight) * upstream).sum(), [weight])


def _embedding_bag(device: torch.device, large: bool) -> Thunk:
    rows, count = _sizes(large)
    weight = _randn(device, rows, 16).requires_grad_()
    idx = _index(device, rows, count)
    offsets = torch.arange(0, count, 8, device=device)
    upstream = _randn(device, count // 8, 16)
    return _grads(
        lambda: (F.embedding_bag(idx, weight, offsets, mode="sum") * upstream).sum(), [weight]
    )


def _conv2d(device: torch.device, large: bool) -> Thunk:
    batch, side = (32, 64) if large else (2, 8)
    x = _randn(device, batch, 8, side, side).requires_grad_()
    weight = _randn(device, 16, 8, 3, 3).requires_grad_()
    upstream = _randn(device, batch, 16, side - 2, side - 2)
    return _grads(lambda: (F.conv2d(x, weight) * upstream).sum(), [x, weight])


def _interpolate(device: torch.device, large: bool) -> Thunk:
    batch, side = (16, 64) if large else (2, 8)
    x = _randn(device, batch, 4, side, side).requires_grad_()
    upstream = _randn(device, batch, 4, side * 3, side * 3)
    return _grads(
        lambda: (
            F.interpolate(x, scale_factor=3, mode="bilinear", align_corners=False) * upstream
        ).sum(),
        [x],
    )


def _cumsum(device: torch.device, large: bool) -> Thunk:
    x = _randn(device, _sizes(large)[1])
    return lambda: torch.cumsum(x, 0)


def _bincount(device: torch.device, large: bool) -> Thunk:
    targets, count = _sizes(large)
    idx, weights = _index(device, targets, count), _randn(device, count)
    return lambda: torch.bincount(idx, weights=weights, minlength=targets)


def _histc(device: torch.device, large: bool) -> Thunk:
    x = _randn(device, _sizes(large)[1])
    return lambda: torch.histc(x, bins=100, min=-3, max=3)


def _matmul(device: torch.device, large: bool) -> Thunk:
    side = 2048 if large else 64
    a, b = _randn(device, side, side), _randn(device, side, side)
    return lambda: a @ b


def placed(
    product: Callable[[torch.Tensor, torch.Tensor], Any],
) -> Callable[[torch.device, bool], Thunk]:
    """A probe whose thunk calls ``product`` on the same values each time, but in other
    memory: each call starts them 4 bytes further, up to 60.

    MKL documents that without its conditional numerical reproducibility
    (``MKL_CBWR``) a result may depend on the inputs' alignment, and a run
    does not choose where its tensors land.
    """

    def build(device: torch.device, large: bool) -> Thunk:
        rows, inner = (256, 4096) if large else (64, 512)
        a, b = _randn(device, rows, inner), _randn(device, inner, inner // 8)
        calls = [0]

        def moved(tensor: torch.Tensor, offset: int) -> torch.Tensor:
            room = torch.zeros(tensor.numel() + offset, device=device)
            return room[offset:].view(tensor.shape).copy_(tensor)

        def run() -> Any:
            calls[0] += 1
            offset = calls[0] % 16
            return product(moved(a, offset), moved(b, 15 - offset))

        return run

    return build


def _bmm(device: torch.device, large: bool) -> Thunk:
    batch, side = (16, 512) if large else (4, 32)
    a, b = _randn(device, batch, side, side), _randn(device, batch, side, side)
    return lambda: torch.bmm(a, b)


def _nll_loss2d(device: torch.device, large: bool) -> Thunk:
    batch, side = (16, 128) if large else (2, 8)
    logp = torch.log_softmax(_randn(device, batch, 10, side, side), 1)
    target = torch.randint(0, 10, (batch, side, side), generator=_gen()).to(device)
    return lambda: F.nll_loss(logp, target)


def _ctc_loss(device: torch.device, large: bool) -> Thunk:
    steps, batch, classes, length = (200, 32, 40, 50) if large else (20, 2, 5, 6)
    log_probs = torch.log_softmax(_randn(device, steps, batch, classes), 2).detach()
    log_probs.requires_grad_()
    targets = torch.randint(1, classes, (batch, length), generator=_gen()).to(device)
    input_lengths = torch.full((batch,), steps, dtype=torch.long)
    target_lengths = torch.full((batch,), length, dtype=torch.long)
    return _grads(
        lambda: F.ctc_loss(log_probs, targets, input_lengths, target_lengths), [log_probs]
    )


def _in_process_group_on(device: torch.device) -> bool:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from detctx.distributed import collective_device

    return collective_device(str(dist.get_backend())).type == device.type


def _all_reduce(device: torch.device, large: bool) -> Thunk:
    from detctx.distributed import collective_device

    target = collective_device(str(torch.distributed.get_backend()))
    x = _randn(target, _sizes(large)[1]) * (torch.distributed.get_rank() + 1)

    def run() -> torch.Tensor:
        out = x.clone()
        torch.distributed.all_reduce(out)
        return out

    return run


PROBE_OPS: Final[tuple[ProbeOp, ...]] = (
    ProbeOp("index_add_", _index_add),
    ProbeOp("scatter_add_", _scatter(None)),
    ProbeOp("scatter_reduce_ sum", _scatter("sum")),
    ProbeOp("scatter_reduce_ mean", _scatter("mean")),
    ProbeOp("index_put_ accumulate", _index_put),
    ProbeOp("embedding backward", _embedding),
    ProbeOp("embedding_bag backward", _embedding_bag),
    ProbeOp("conv2d backward", _conv2d),
    ProbeOp("interpolate backward", _interpolate),
    ProbeOp("cumsum", _cumsum),
    ProbeOp("bincount weights", _bincount),
    ProbeOp("histc", _histc),
    ProbeOp("matmul", _matmul),
    ProbeOp("bmm", _bmm),
    ProbeOp("matmul, inputs moved in memory", placed(torch.matmul)),
    ProbeOp("nll_loss2d", _nll_loss2d),
    ProbeOp("ctc_loss backward", _ctc_loss),
    ProbeOp("all_reduce", _all_reduce, _in_process_group_on),
)
"""The ops probed by default, in the order they are reported."""
