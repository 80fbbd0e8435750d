"""``deterministic_region`` when its backward fails, and when several threads run regions."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import detctx

Setting = tuple[bool, bool]
CALLERS: list[Setting] = [(False, False), (True, True)]


def flags() -> Setting:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def set_flags(setting: Setting) -> None:
    torch.use_deterministic_algorithms(setting[0], warn_only=setting[1])


class Fails(torch.autograd.Function):
    """A custom function whose backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the backward of a custom function failed")


def failing_function(t: torch.Tensor) -> torch.Tensor:
    return Fails.apply(t * 2) * 3  # type: ignore[no-any-return,no-untyped-call]


def failing_hook(t: torch.Tensor) -> torch.Tensor:
    middle = t * 2

    def hook(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a tensor hook failed")

    middle.register_hook(hook)
    return middle * 3


PARTS = {"custom function": failing_function, "tensor hook": failing_hook}


@pytest.mark.parametrize("caller", CALLERS, ids=["off", "warn-only"])
@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_backward_that_fails_inside_the_region_puts_the_callers_setting_back(
    part: str, caller: Setting
) -> None:
    set_flags(caller)
    region = detctx.deterministic_region(PARTS[part])
    x = torch.randn(3, requires_grad=True)

    with pytest.raises(RuntimeError, match="failed"):
        region(x).sum().backward()

    assert flags() == caller


def test_a_failed_backward_in_a_nested_region_puts_back_every_level() -> None:
    inner = detctx.deterministic_region(failing_hook, algorithms="warn")
    outer = detctx.deterministic_region(lambda t: inner(t + 1) * 2)
    x = torch.randn(3, requires_grad=True)

    with pytest.raises(RuntimeError, match="a tensor hook failed"):
        outer(x).sum().backward(retain_graph=True)
    assert flags() == (False, False)
    with pytest.raises(RuntimeError, match="a tensor hook failed"):
        torch.autograd.grad(outer(x).sum(), x)
    assert flags() == (False, False)


def test_after_a_failed_backward_the_next_one_is_covered_as_before() -> None:
    seen: list[bool] = []
    fail = [False, True]  # popped from the end: the first pass fails, the second not

    def part(t: torch.Tensor) -> torch.Tensor:
        middle = t * 2

        def hook(grad: torch.Tensor) -> torch.Tensor:
            seen.append(torch.are_deterministic_algorithms_enabled())
            if fail.pop():
                raise RuntimeError("a tensor hook failed")
            return grad

        middle.register_hook(hook)
        return middle * 3

    region = detctx.deterministic_region(part)
    with pytest.raises(RuntimeError):
        region(torch.randn(3, requires_grad=True)).sum().backward()
    region(torch.randn(3, requires_grad=True)).sum().backward()

    assert seen == [True, True]
    assert flags() == (False, False)


def _run_threads(count: int, work: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as exc:  # reported by the test below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward only", "forward+backward"])
@pytest.mark.parametrize("threads", [2, 4])
def test_regions_in_several_threads_leave_the_callers_setting_once_all_have_finished(
    threads: int, backward: bool
) -> None:
    # Before: left on after 14 of 20 rounds with 2 threads, 20 of 20 with 4.
    rounds_left_on = 0
    region = detctx.deterministic_region(nn.Linear(8, 8))

    def work() -> None:
        for _ in range(30):
            out = region(torch.randn(4, 8, requires_grad=backward))
            if backward:
                out.sum().backward()

    for caller in CALLERS * 10:
        set_flags(caller)
        _run_threads(threads, work)
        rounds_left_on += flags() != caller

    assert rounds_left_on == 0


def test_while_one_thread_is_inside_a_region_every_thread_sees_the_flag_on() -> None:
    inside, release = threading.Event(), threading.Event()

    def part(t: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(timeout=60)
        return t * 2

    region = detctx.deterministic_region(part)
    thread = threading.Thread(target=lambda: region(torch.ones(2)))
    thread.start()
    inside.wait(timeout=60)
    seen_meanwhile = flags()
    release.set()
    thread.join()

    assert seen_meanwhile == (True, False)
    assert flags() == (False, False)


def test_regions_ending_out_of_order_in_two_threads_keep_the_flag_on_until_the_last_ends() -> None:
    steps = {name: threading.Event() for name in ("a in", "b in", "a may leave", "a out")}

    def part_a(t: torch.Tensor) -> torch.Tensor:
        steps["a in"].set()
        steps["a may leave"].wait(timeout=60)
        return t

    def part_b(t: torch.Tensor) -> torch.Tensor:
        steps["b in"].set()
        steps["a out"].wait(timeout=60)
        seen.append(flags())
        return t

    seen: list[Setting] = []
    a = threading.Thread(target=lambda: detctx.deterministic_region(part_a)(torch.ones(1)))
    b = threading.Thread(target=lambda: detctx.deterministic_region(part_b)(torch.ones(1)))
    a.start()
    steps["a in"].wait(timeout=60)
    b.start()
    steps["b in"].wait(timeout=60)
    steps["a may leave"].set()
    a.join()
    seen.append(flags())  # a has ended, b still runs
    steps["a out"].set()
    b.join()

    assert seen == [(True, False), (True, False)]
    assert flags() == (False, False)
