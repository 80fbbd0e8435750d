"""Scalar arguments are recorded, compared and shown: a norm's eps or dropout's p changed in B
is named at its op, even where the values it changes stay within tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import detctx
from detctx._compare.reading import read_trace
from detctx._compare.scalars import scalar_difference

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(path: Path, eps: float = 1e-5, p: float = 0.1, scale: float = 0.5) -> Path:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16, eps=eps), torch.nn.Dropout(p)
    )
    x = torch.randn(4, 8)
    with detctx.recording(path):
        (net(x) * scale).sum().backward()
    return path


def test_a_norm_eps_changed_below_the_tolerance_is_named_at_its_op(tmp_path: Path) -> None:
    a, b = run(tmp_path / "a.trace"), run(tmp_path / "b.trace", eps=1.1e-5)
    result = detctx.compare_traces(a, b)
    assert not result.agree
    origin = result.origin
    assert origin is not None and origin.op == "aten::native_layer_norm"
    assert origin.module_path == "Sequential.1"
    assert origin.difference == "eps 1e-05 in A, 1.1e-05 in B"
    assert origin.error < origin.tolerance  # the values alone would have agreed


def test_dropout_p_changed_is_named_at_the_dropout(tmp_path: Path) -> None:
    a, b = run(tmp_path / "a.trace"), run(tmp_path / "b.trace", p=0.2)
    origin = detctx.compare_traces(a, b).origin
    assert origin is not None and origin.module_path == "Sequential.2"
    # Dropout draws its mask with the probability to keep: 1 - p.
    assert origin.op == "aten::bernoulli_.float"
    assert origin.difference == "p 0.9 in A, 0.8 in B"


def test_the_scalars_are_in_the_trace_and_equal_ones_agree_bit_for_bit(tmp_path: Path) -> None:
    a, b = run(tmp_path / "a.trace"), run(tmp_path / "b.trace")
    trace = read_trace(a)
    texts = [(trace.text(op), trace.text(args)) for op, args in trace.ops[["op", "scalars"]]]
    assert ("aten::native_layer_norm", "eps=1e-05") in texts
    assert ("aten::mul.Tensor", "other=0.5") in texts  # the scale, a Python float
    assert detctx.compare_traces(a, b).bitwise


def test_a_float_scalar_within_the_tolerance_is_not_a_difference(tmp_path: Path) -> None:
    # A scale computed another way on another machine, equal but for its last bits.
    a = run(tmp_path / "a.trace", scale=0.3)
    b = run(tmp_path / "b.trace", scale=0.3 * (1 + 1e-7))
    assert "other=0.3" in read_trace(a).strings and "other=0.3" not in read_trace(b).strings
    result = detctx.compare_traces(a, b)
    assert result.agree and result.past_tolerance == []


@pytest.mark.parametrize(
    ("a", "b", "said"),
    [
        ("dim=1", "dim=2", "dim 1 in A, 2 in B"),
        ("alpha=1", "", "alpha 1 in A, (not given) in B"),
        ("eps=1e-05, momentum=0.1", "eps=1e-05, momentum=0.01", "momentum 0.1 in A, 0.01 in B"),
        ("p=0.5, train=True", "p=0.5, train=False", "train True in A, False in B"),
        ("other=0.30000000000000004", "other=0.3", None),
        ("other=nan", "other=nan", None),
        ("other=inf", "other=1e+308", "other inf in A, 1e+308 in B"),
    ],
)
def test_what_differs_in_scalar_arguments_is_said_by_name(a: str, b: str, said: str | None) -> None:
    assert scalar_difference(a, b, 3e-4) == said


def test_gelu_switched_to_its_tanh_form_is_named_at_the_gelu(tmp_path: Path) -> None:
    def record(path: Path, approximate: str) -> Path:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate))
        with detctx.recording(path):
            net(torch.randn(4, 8)).sum().backward()
        return path

    a, b = record(tmp_path / "a.trace", "none"), record(tmp_path / "b.trace", "tanh")
    origin = detctx.compare_traces(a, b).origin
    assert origin is not None and origin.op == "aten::gelu" and origin.module_path == "Sequential.1"
    assert origin.difference == "approximate (not given) in A, 'tanh' in B"  # 'none': the default
