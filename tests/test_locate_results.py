"""locate_divergence on nested tensors, and on runs whose results differ while no op does."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import numpy as np
import pytest
import torch

import detctx
from detctx._locate.outputs import first_result_difference, result_leaves


def _jagged() -> torch.layout | None:
    """torch's jagged layout, where this torch builds nested tensors in it (2.2 and later)."""
    layout = getattr(torch, "jagged", None)
    try:
        torch.nested.nested_tensor([torch.ones(1), torch.ones(2)], layout=layout)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None
    return layout


LAYOUTS = [pytest.param(torch.strided, id="strided"), pytest.param(_jagged(), id="jagged")]


def nested(parts: list[torch.Tensor], layout: torch.layout | None) -> torch.Tensor:
    if layout is None:
        pytest.skip("this torch builds no jagged nested tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout's "prototype stage" warning
        if layout is torch.strided:  # the default layout; torch 2.1 takes no layout argument
            return torch.nested.nested_tensor(parts)
        return torch.nested.nested_tensor(parts, layout=layout)


def entropy() -> float:
    return (int.from_bytes(os.urandom(6), "little") + 1) / 2**48


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_identical_runs_through_nested_tensors_agree(layout):
    def step() -> torch.Tensor:
        batch = nested([torch.randn(2, 3), torch.randn(4, 3)], layout)
        scaled = torch.nn.functional.relu(batch * 2 + 1)
        return scaled.to_padded_tensor(0.0).sum()

    assert detctx.locate_divergence(step) is None
    assert detctx.locate_divergence(step, runs=3, seed=11) is None


def test_the_backward_pass_of_a_jagged_tensor_records_and_identical_runs_agree():
    layout = _jagged()

    def step() -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = nested([torch.randn(2, 3), torch.randn(4, 3)], layout)
        batch.requires_grad_(True)
        weights = torch.randn(5, 3, requires_grad=True)
        # Its backward makes jagged tensors whose offsets live on the meta device.
        torch.nn.functional.linear(batch, weights).values().sum().backward()
        return weights.grad, batch.grad

    assert detctx.locate_divergence(step) is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nested_tensor_whose_values_differ_is_named_at_the_op_that_made_them(layout):
    def step() -> None:
        batch = nested([torch.ones(2, 3), torch.ones(4, 3)], layout)
        batch * entropy()  # mixes in entropy

    found = detctx.locate_divergence(step)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::mul.Tensor"
    assert found.shape == (3,) or found.shape[0] in (2, 4)  # a component, counted


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nested_tensors_whose_component_sizes_differ_are_a_divergence(layout):
    def step() -> None:
        length = 2 + os.urandom(1)[0] % 2 + (os.urandom(1)[0] % 64) * 2
        nested([torch.ones(2, 3), torch.ones(length, 3)], layout).mul(2.0)  # ops torch 2.1 has

    found = None
    for _ in range(3):  # the two lengths agree once in 64, at worst
        found = found or detctx.locate_divergence(step)
    assert found is not None and found.reason == "values"


def test_a_result_from_numpy_that_is_only_cloned_is_reported_as_a_result_divergence():
    found = detctx.locate_divergence(
        lambda: torch.from_numpy(np.random.default_rng().random(4)).clone()
    )

    assert found is not None
    assert found.reason == "result" and found.path == "result"
    assert "outside torch ops" in str(found)
    assert "float64 tensor of shape (4,)" in str(found)
    assert found.source.endswith(f"test_locate_results.py:{_line_of_the_lambda()}")


def _line_of_the_lambda() -> int:
    source = open(__file__, encoding="utf-8").read().splitlines()
    return next(i + 1 for i, line in enumerate(source) if "lambda: torch.from_numpy" in line)


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    extra: dict[str, object]


def test_the_first_differing_part_of_a_nested_result_is_named():
    def step() -> Output:
        weights = torch.randn(3, 3)
        return Output((weights @ weights).sum(), {"count": 3, "noise": [1.0, entropy()]})

    found = detctx.locate_divergence(step)

    assert found is not None and found.reason == "result"
    assert found.path == 'result.extra["noise"][1]'
    assert found.reference == "a float"


def test_results_that_agree_and_results_with_nothing_to_compare_report_none():
    model = torch.nn.Linear(3, 2)

    def step() -> tuple[object, ...]:
        loss = model(torch.randn(4, 3)).pow(2).mean()
        return loss, model, object(), lambda: None, {"rows": np.arange(4.0), "name": "x"}

    assert detctx.locate_divergence(step) is None


def test_a_divergence_in_the_ops_is_reported_before_the_results():
    def step() -> torch.Tensor:
        return torch.ones(3) * entropy()  # entropy in an op

    found = detctx.locate_divergence(step)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::mul.Tensor"


def test_a_nested_tensor_in_a_result_is_compared_by_its_components():
    parts = [torch.ones(2), torch.ones(3)]
    first = result_leaves(nested(parts, torch.strided))
    same = result_leaves(nested([part.clone() for part in parts], torch.strided))
    other = result_leaves(nested([torch.ones(2), torch.zeros(3)], torch.strided))

    assert first_result_difference(first, same) is None
    found = first_result_difference(first, other)
    assert found is not None and "nested float32 tensor of shape (2, 3)" in found.what


def test_results_of_another_structure_differ_at_the_first_part_that_does():
    first = result_leaves({"a": 1, "b": [1, 2]})

    assert first_result_difference(first, result_leaves({"a": 1, "b": [1, 2]})) is None
    found = first_result_difference(first, result_leaves({"a": 1, "b": [1, 2, 3]}))
    assert found is not None and found.path == 'result["b"]'
    found = first_result_difference(first, result_leaves({"a": 1, "c": [1, 2]}))
    assert found is not None and found.path == "result"


def test_a_partial_is_named_by_the_function_it_wraps():
    def step(scale: float) -> float:
        return scale * entropy()

    found = detctx.locate_divergence(functools.partial(step, 2.0))

    assert found is not None and found.reason == "result"
    assert found.source.endswith(f"test_locate_results.py:{step.__code__.co_firstlineno}")


def test_a_result_that_holds_itself_is_not_compared_and_nothing_is_raised():
    def step() -> list[object]:
        loop: list[object] = [torch.ones(2).sin()]
        loop.append(loop)
        return loop

    assert detctx.locate_divergence(step) is None


def test_two_identical_runs_through_scaled_dot_product_attention_agree():
    # torch 2.1's CPU flash kernel returns, besides its output and log-sum-exp,
    # 0-dim tensors of uninitialised memory: bookkeeping that must not count.
    def attend():
        torch.manual_seed(0)
        q = torch.randn(2, 4, 16, 8, requires_grad=True)
        torch.randn(4096)  # other allocations between the runs' kernels
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
        return out.detach(), q.grad

    assert detctx.locate_divergence(attend) is None
