"""``deterministic_region``: a part whose forward and backward run deterministic, the rest not.

Every scenario puts a recording ``autograd.Function`` inside and outside the
region; its backward records ``torch.are_deterministic_algorithms_enabled()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import detctx

Log = list[tuple[str, str, bool]]


def flags() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def recorder(log: Log) -> Any:
    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, tag: str) -> torch.Tensor:
            ctx.tag = tag
            log.append(("forward", tag, torch.are_deterministic_algorithms_enabled()))
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            log.append(("backward", ctx.tag, torch.are_deterministic_algorithms_enabled()))
            return grad, None

    return Record.apply


def backward_log(log: Log) -> dict[str, list[bool]]:
    seen: dict[str, list[bool]] = {}
    for kind, tag, enabled in log:
        if kind == "backward":
            seen.setdefault(tag, []).append(enabled)
    return seen


class Part(nn.Module):
    def __init__(self, record: Any, tag: str = "inside") -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.record, self.tag = record, tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.record(self.linear(x), self.tag)


def test_the_regions_backward_is_deterministic_and_the_callers_ops_are_not() -> None:
    log: Log = []
    record = recorder(log)
    region = detctx.deterministic_region(Part(record))
    x = torch.randn(2, 3, requires_grad=True)
    loss = record(region(record(x, "before")), "after").sum()
    assert not torch.are_deterministic_algorithms_enabled()
    loss.backward()
    assert [entry[:2] for entry in log if entry[0] == "forward"] == [
        ("forward", "before"),
        ("forward", "inside"),
        ("forward", "after"),
    ]
    assert log[1][2] is True and log[0][2] is False and log[2][2] is False
    assert backward_log(log) == {"after": [False], "inside": [True], "before": [False]}
    assert flags() == (False, False)
    assert x.grad is not None and region.module.linear.weight.grad is not None


def test_a_region_restores_the_callers_warn_only_setting_rather_than_forcing_it_off() -> None:
    log: Log = []
    record = recorder(log)
    region = detctx.deterministic_region(lambda t: record(t * 2, "inside"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    x = torch.randn(3, requires_grad=True)
    loss = record(region(record(x, "before")), "after").sum()
    assert flags() == (True, True)
    loss.backward()
    assert backward_log(log) == {"after": [True], "inside": [True], "before": [True]}
    assert flags() == (True, True)


def test_a_region_whose_inputs_do_not_require_grad_still_covers_its_parameters() -> None:
    log: Log = []
    record = recorder(log)
    region = detctx.deterministic_region(Part(record))
    elsewhere = record(torch.randn(2, 3, requires_grad=True), "elsewhere")  # made first
    loss = (record(region(torch.randn(2, 3)), "after") * elsewhere).sum()
    loss.backward()
    seen = backward_log(log)
    assert seen == {"after": [False], "inside": [True], "elsewhere": [False]}
    assert flags() == (False, False)
    assert region.module.linear.weight.grad is not None


def test_a_region_called_twice_in_one_forward_covers_both_calls_only() -> None:
    log: Log = []
    record = recorder(log)
    region = detctx.deterministic_region(Part(record))
    x = torch.randn(2, 3, requires_grad=True)
    first = region(record(x, "before"))
    between = record(first, "between")
    second = region(between)
    record(second + first, "after").sum().backward()
    assert backward_log(log) == {
        "after": [False],
        "inside": [True, True],
        "between": [False],
        "before": [False],
    }
    assert flags() == (False, False)


def test_nested_regions_each_put_back_what_they_found() -> None:
    log: Log = []
    record = recorder(log)
    inner = detctx.deterministic_region(lambda t: record(t * 3, "inner"), algorithms="warn")

    def outer_part(t: torch.Tensor) -> torch.Tensor:
        t = record(t, "outer before inner")
        seen_inside.append(flags())
        return record(inner(t), "outer after inner")

    seen_inside: list[tuple[bool, bool]] = []
    outer = detctx.deterministic_region(outer_part)
    x = torch.randn(3, requires_grad=True)
    record(outer(x), "after").sum().backward()
    assert seen_inside == [(True, False)]
    assert backward_log(log) == {
        "after": [False],
        "outer after inner": [True],
        "inner": [True],
        "outer before inner": [True],
    }
    assert flags() == (False, False)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_around_a_region_recomputes_and_backpropagates_deterministically(
    reentrant: bool,
) -> None:
    log: Log = []
    record = recorder(log)
    region = detctx.deterministic_region(Part(record))
    x = torch.randn(2, 3, requires_grad=True)
    out = checkpoint(region, record(x, "before"), use_reentrant=reentrant)
    record(out, "after").sum().backward()
    # The forward, its recomputation (which may stop early once the saved tensors are back)
    # and the backward all ran with determinism on.
    inside = [enabled for kind, tag, enabled in log if tag == "inside"]
    assert len(inside) >= 2 and all(inside)
    assert backward_log(log) == {"after": [False], "inside": [True], "before": [False]}
    assert flags() == (False, False)
    assert x.grad is not None and region.module.linear.weight.grad is not None


def test_a_backward_pass_that_stops_inside_the_region_puts_the_flag_back() -> None:
    log: Log = []
    record = recorder(log)
    kept: list[torch.Tensor] = []

    def part(t: torch.Tensor) -> torch.Tensor:
        middle = record(t * 2, "inside")
        kept.append(middle)
        return middle * 3

    x = torch.randn(3, requires_grad=True)
    out = detctx.deterministic_region(part)(x)
    (grad,) = torch.autograd.grad(out.sum(), kept[0])
    assert torch.equal(grad, torch.full((3,), 3.0))
    assert flags() == (False, False)


def test_outputs_in_tuples_and_dicts_are_covered_and_keep_their_types() -> None:
    log: Log = []
    record = recorder(log)

    def part(t: torch.Tensor) -> dict[str, Any]:
        return {"a": (record(t, "a"), 1), "b": [record(t * 2, "b")]}

    x = torch.randn(3, requires_grad=True)
    result = detctx.deterministic_region(part)(x)
    assert isinstance(result, dict) and isinstance(result["a"], tuple) and result["a"][1] == 1
    (result["a"][0] + result["b"][0]).sum().backward()
    assert backward_log(log) == {"a": [True], "b": [True]}
    assert torch.equal(x.grad, torch.full((3,), 3.0))  # type: ignore[arg-type]
    assert flags() == (False, False)


def test_an_in_place_op_after_the_region_works_as_it_does_without_it() -> None:
    torch.manual_seed(0)
    part = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    nn.functional.relu(part(x), inplace=True).sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    out = detctx.deterministic_region(part)(x)
    nn.functional.relu(out, inplace=True).sum().backward()
    assert torch.equal(x.grad, expected)  # type: ignore[arg-type]
    assert flags() == (False, False)


def test_a_region_computes_what_the_bare_part_computes() -> None:
    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    bare = part(x).square().sum()
    bare.backward()
    expected = [p.grad.clone() for p in part.parameters()]  # type: ignore[union-attr]
    part.zero_grad()
    region = detctx.deterministic_region(part)
    covered = region(x).square().sum()
    covered.backward()
    assert torch.equal(bare, covered)
    assert all(torch.equal(p.grad, e) for p, e in zip(part.parameters(), expected))  # type: ignore[arg-type]


def test_an_exception_in_the_regions_forward_leaves_the_flag_as_it_was() -> None:
    def broken(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        detctx.deterministic_region(broken)(torch.randn(3, requires_grad=True))
    assert flags() == (False, False)


def test_under_no_grad_a_region_only_switches_its_forward() -> None:
    seen: list[bool] = []
    region = detctx.deterministic_region(
        lambda t: seen.append(torch.are_deterministic_algorithms_enabled()) or t * 2
    )
    with torch.no_grad():
        out = region(torch.randn(3, requires_grad=True))
    assert seen == [True] and out.grad_fn is None and flags() == (False, False)


def test_a_module_region_keeps_the_module_reachable() -> None:
    part = nn.Linear(3, 2)
    region = detctx.deterministic_region(part)
    assert isinstance(region, detctx.DeterministicRegion) and region.module is part
    assert region.weight is part.weight and region.out_features == 2
    assert list(region.state_dict()) == ["module.weight", "module.bias"]
    assert "algorithms=True" in repr(region)


def test_bad_arguments_fail_when_the_region_is_made() -> None:
    with pytest.raises(ValueError, match="True or 'warn'"):
        detctx.deterministic_region(nn.Linear(2, 2), algorithms=False)
    with pytest.raises(TypeError, match=r"nn\.Module or a function"):
        detctx.deterministic_region(3)  # type: ignore[call-overload]

    def generator() -> Any:
        yield 1

    with pytest.raises(TypeError, match="not generator or coroutine"):
        detctx.deterministic_region(generator)


@settings(max_examples=40, deadline=None)
@given(
    caller=st.sampled_from([(False, False), (True, False), (True, True)]),
    setting=st.sampled_from([True, "warn"]),
    calls=st.integers(min_value=1, max_value=3),
    retain=st.booleans(),
)
def test_after_any_backward_the_flag_is_what_the_caller_had(
    caller: tuple[bool, bool], setting: Any, calls: int, retain: bool
) -> None:
    torch.use_deterministic_algorithms(caller[0], warn_only=caller[1])
    try:
        log: Log = []
        record = recorder(log)
        region = detctx.deterministic_region(lambda t: record(t.sin(), "inside"), setting)
        x = torch.randn(3, requires_grad=True)
        out = record(x, "before")
        for _ in range(calls):
            out = record(region(out), "between")
        loss = out.sum()
        for _ in range(2 if retain else 1):
            loss.backward(retain_graph=retain)
            assert flags() == caller
        seen = backward_log(log)
        assert seen["inside"] == [True] * (calls * (2 if retain else 1))
        assert set(seen["between"]) == set(seen["before"]) == {caller[0]}
    finally:
        torch.use_deterministic_algorithms(False)
