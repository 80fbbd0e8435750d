"""Origins under kernel noise: an op is an origin when its error is more than its inputs can
explain for its kind. AdamW dividing a zero-but-for-rounding gradient by eps, a bias
gradient that cancels to rounding, are inherited noise; a real change to one parameter's
update, or to a matrix product whose inputs carry noise, is still named."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch

import detctx
from detctx._compare.explained import Value, explained_error, kind_of
from detctx._compare.format import READ_OP
from detctx._compare.reading import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.planting import Planter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NOISE = 1e-7
"""B's input moved by this relative amount: rounding noise entering at the batch, which every
later op carries, as another kernel's would."""


class Attention(torch.nn.Module):
    """One attention head: softmax ignores a constant added to every key, so the key
    projection's bias gets a gradient that is zero but for rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.query = torch.nn.Linear(32, 32)
        self.key = torch.nn.Linear(32, 32)
        self.value = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(1, 2) / math.sqrt(32)
        return self.head(torch.softmax(scores, -1) @ self.value(x))


def run(path: Path, noise: float = 0.0, planter: Planter | None = None) -> Path:
    torch.manual_seed(0)
    model = Attention()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 16, 32)
    labels = torch.randint(0, 4, (4, 16))
    if noise:
        moved = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
        x = x * (1 + noise * moved)
    with planter or contextlib.nullcontext(), detctx.recording(path):
        for _ in range(2):
            optimizer.zero_grad()
            logits = model(x).flatten(0, 1)
            torch.nn.functional.cross_entropy(logits, labels.flatten()).backward()
            optimizer.step()
    return path


@pytest.fixture
def traces(tmp_path: Path) -> tuple[Path, Path]:
    return run(tmp_path / "a.trace"), run(tmp_path / "b.trace", NOISE)


def test_adamw_stepping_a_bias_whose_gradient_is_rounding_is_inherited_noise(
    traces: tuple[Path, Path],
) -> None:
    result = detctx.compare_traces(*traces)
    past = {entry.op: entry for entry in result.past_tolerance}
    # The key bias's gradient sum, and AdamW's update of it, are far past the tolerance...
    assert past["aten::sum.dim_IntList"].error > 0.1
    assert "[parameter Attention.key.bias]" in past["aten::addcdiv_"].source
    # ...and explained by their inputs: a sum that cancels, a division by eps.
    assert result.origin is None
    assert {entry.kind for entry in result.past_tolerance} == {"inherited"}


def program_index(path: Path, op: str, source: str) -> tuple[int, int]:
    """The trace index of the first op named ``op`` whose source has ``source``, and its
    place among the program's ops (the planting mode counts those)."""
    trace = read_trace(path)
    place = 0
    for index, (number, where) in enumerate(zip(trace.ops["op"], trace.ops["source"])):
        name = trace.text(int(number))
        if name == op and source in trace.text(int(where)):
            return index, place
        place += not name.startswith("detctx::")
    raise AssertionError(f"no {op} at {source}")


@pytest.mark.parametrize(
    ("op", "source"),
    [
        ("aten::addcdiv_", "[parameter Attention.query.weight]"),  # AdamW's update
        ("aten::lerp_.Scalar", ""),  # the first moment of the first parameter
        ("aten::sum.dim_IntList", ""),  # the head's bias gradient
        ("aten::bmm", ""),  # a matrix product whose inputs carry the noise
    ],
)
def test_a_change_of_one_percent_is_named_where_the_noise_is_not(
    traces: tuple[Path, Path], tmp_path: Path, op: str, source: str
) -> None:
    a, b = traces
    index, place = program_index(b, op, source)
    planter = Planter(place, op, "x(1+1e-2)")
    planted = run(tmp_path / "planted.trace", NOISE, planter)
    assert planter.planted_name == op
    origin = detctx.compare_traces(a, planted).origin
    assert origin is not None and (origin.index, origin.op) == (index, op)


def test_a_parameter_changed_before_the_recording_is_named_where_first_read(
    tmp_path: Path,
) -> None:
    a = run(tmp_path / "a.trace")
    torch.manual_seed(0)
    with torch.no_grad():
        changed = Attention()
        changed.value.weight.mul_(1.01)
    b = tmp_path / "b.trace"
    optimizer = torch.optim.AdamW(changed.parameters(), lr=1e-2)
    x, labels = torch.randn(4, 16, 32), torch.randint(0, 4, (4, 16))
    with detctx.recording(b):
        for _ in range(2):
            optimizer.zero_grad()
            logits = changed(x).flatten(0, 1)
            torch.nn.functional.cross_entropy(logits, labels.flatten()).backward()
            optimizer.step()
    result = detctx.compare_traces(a, b)
    origin = result.origin
    assert origin is not None and origin.op == READ_OP
    assert origin.source == "[parameter Attention.value.weight]"
    assert "parameters or buffers differ where the program first reads them" in result.format()


def value(error: float, norm: float = 1.0, low: float = -1.0, high: float = 1.0) -> Value:
    return Value(error, norm, low, high, 100.0, (10, 10))


def test_a_quotient_by_tiny_divisors_explains_much_an_element_wise_sum_explains_little() -> None:
    out = value(0.0, norm=10.0, low=-1.0, high=1.0)
    divided = explained_error(
        "aten::addcdiv_",
        {"value": -0.01},
        [value(0.0), value(1e-9, 1e-3), value(3e-8, 0.08, 1e-8, 0.02)],
        out,
    )
    assert divided is not None and divided > 1e-3  # 0.01 * 1e-9 / 1e-8 and more
    summed = explained_error("aten::add.Tensor", {}, [value(1e-6), value(2e-6)], out)
    assert summed is not None and summed < 1e-5
    assert explained_error("aten::add.Tensor", {}, [value(0.0), value(0.0)], out) == pytest.approx(
        8 * 2.0**-24 * 10.0  # its own rounding only
    )


def test_kinds_without_a_bound_or_inputs_of_unknown_size_fall_back_to_growth() -> None:
    out = value(0.0)
    assert explained_error("aten::native_layer_norm", {}, [value(1e-6)], out) is None
    assert explained_error("aten::mul.Tensor", {}, [value(1e-6), None], out) is None
    # A product read through an expanded view: its statistics are another tensor's.
    square = Value(1e-6, 1.0, -1.0, 1.0, 64.0, (8, 8))
    row = Value(1e-6, 1.0, -1.0, 1.0, 8.0, (8,))
    assert explained_error("aten::mm", {}, [square, square], square) is not None
    assert explained_error("aten::mm", {}, [square, row], square) is None
    assert kind_of("aten::addcdiv_") == "addcdiv" and kind_of("aten::div.Tensor") == "div"


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"),
    reason="this torch has no flash SDPA kernel on the CPU",
)
def test_a_gqa_llama_with_the_math_kernel_against_its_default_agrees(tmp_path: Path) -> None:
    # The math kernel's backward adds ops, and runs a key's rotary multiplies (by cos, by
    # sin) in another order: paired by where their inputs come from, not by name and order.
    pytest.importorskip("transformers")
    from benchmarks.planting import record
    from benchmarks.planting_models import FAMILIES

    family = FAMILIES["llama"]
    model, batch = family.build(149)
    record(family, model, batch, "same", tmp_path / "a.trace")
    record(family, model, batch, "sdpa_math", tmp_path / "b.trace")
    result = detctx.compare_traces(tmp_path / "a.trace", tmp_path / "b.trace")
    assert result.agree and result.origin is None, result.past_tolerance[:2]
    assert not result.bitwise  # another kernel: compared within tolerance


def relu_run(path: Path, flip: bool | None, planter: Planter | None = None) -> Path:
    """A ReLU layer whose pre-activation ``[0, 0]`` is ``x[0, 0] - x[0, 1]``, exactly 0 in
    A (``flip=None``). B's input carries noise, as another kernel's rounding would; with
    ``flip`` the difference comes out positive there (one mask element passes in B that A
    stops), without it negative (both runs stop it)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, generator=generator)
    x[0, 1] = x[0, 0]
    first = torch.nn.Linear(16, 32)
    second = torch.nn.Linear(32, 3)
    with torch.no_grad():
        first.weight.copy_(torch.randn(32, 16, generator=generator) / 4)
        first.bias.zero_()
        second.weight.copy_(torch.randn(3, 32, generator=generator))
        first.weight[0] = 0.0
        first.weight[0, :2] = torch.tensor([1.0, -1.0])
    labels = torch.tensor([0, 1, 2, 0])
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    if planter is not None or flip is not None:
        moved = x * (1 + NOISE * torch.randn(x.shape, generator=generator))
        assert moved[0, 0] != moved[0, 1]  # the noise moves the two apart
        x = moved
        if (x[0, 0] > x[0, 1]) != flip:
            x[0, :2] = x[0, :2].flip(0)
    with planter or contextlib.nullcontext(), detctx.recording(path):
        for _ in range(2):
            optimizer.zero_grad()
            logits = second(torch.relu(first(x)))
            torch.nn.functional.cross_entropy(logits, labels).backward()
            optimizer.step()
    return path


def test_a_relu_mask_element_rounding_flips_is_inherited_noise(tmp_path: Path) -> None:
    # One element the mask stops in A and passes in B: an error of a twentieth of the
    # ReLU's backward, from an input error of 1e-7. The mask's count of zeros says so.
    a = relu_run(tmp_path / "a.trace", None)
    b = relu_run(tmp_path / "b.trace", True)
    result = detctx.compare_traces(a, b)
    masks = [entry for entry in result.past_tolerance if entry.op == "aten::threshold_backward"]
    assert len(masks) == 2 and all(entry.error > 1e-2 for entry in masks)  # one a step
    assert {entry.kind for entry in masks} == {"inherited"}
    assert result.origin is None


def test_a_change_at_a_relu_backward_whose_mask_did_not_flip_is_named(tmp_path: Path) -> None:
    a = relu_run(tmp_path / "a.trace", None)
    b = relu_run(tmp_path / "b.trace", False)
    assert detctx.compare_traces(a, b).origin is None  # the noise alone
    index, place = program_index(b, "aten::threshold_backward", "")
    planter = Planter(place, "aten::threshold_backward", "x(1+1e-2)")
    planted = relu_run(tmp_path / "planted.trace", False, planter)
    result = detctx.compare_traces(a, planted)
    origin = result.origin
    assert origin is not None and (origin.index, origin.op) == (index, planter.planted_name)
    assert "as many zeros in both runs" in result.format()
