"""A compare's "agree" is worth only what it checked: runs of other lengths, a missing rank,
another element count, swapped values, huge values and crafted statistics each come out as a
difference or a refusal, never as agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import detctx
from detctx._cli import main
from detctx._compare.format import READ_OP, TraceWriter
from detctx._compare.parting import UNSEEN_ADVICE
from detctx._compare.reading import read_trace
from detctx._compare.stacked import statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(steps: int, *, stop_at: int | None = None, scale_after: bool = False) -> None:
    """A small MLP trained with AdamW; ``stop_at`` raises KeyboardInterrupt at that step (as
    Ctrl-C would), ``scale_after`` scales a weight in place after the last step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(40, 4, 8)
    for step in range(steps):
        if step == stop_at:
            raise KeyboardInterrupt
        optimiser.zero_grad()
        model(data[step]).square().mean().backward()
        optimiser.step()
    if scale_after:
        with torch.no_grad():
            model[0].weight.mul_(1.5)


def record(path: Path, body: Callable[[], object]) -> Path:
    with detctx.recording(path):
        body()
    return path


def compare(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = main(["compare", str(a), str(b), "--json"])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("steps_b", [11, 15, 20])
def test_a_run_of_more_steps_does_not_agree_and_its_extra_ops_are_named(
    steps_b: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", lambda: train(10))
    b = record(tmp_path / "b.trace", lambda: train(steps_b))
    status, result = compare(a, b, capsys)
    assert status == 1 and not result["agree"] and not result["bitwise"]
    assert result["past_tolerance"] == []
    (extra,) = result["unpaired"]
    assert extra["trace"] == "B" and extra["at_end"]
    assert extra["last"] == result["ops"][0]["b"] - 1
    assert extra["ops"] == result["ops"][0]["b"] - result["ops"][0]["a"]
    # The text says the same: which run has them and where.
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"only in B: rank 0 ops {extra['first']}..{extra['last']}" in out
    assert "at the end of B" in out and "traces DIFFER" in out and "AGREE" not in out


def test_a_run_cut_by_ctrl_c_does_not_agree_with_the_whole_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", lambda: train(40))
    with pytest.raises(KeyboardInterrupt):
        record(tmp_path / "b.trace", lambda: train(40, stop_at=26))
    assert read_trace(tmp_path / "b.trace").outcome == "raised KeyboardInterrupt"
    status, result = compare(a, tmp_path / "b.trace", capsys)
    assert status == 1 and not result["agree"]
    assert result["not_completed"] == {"B": "rank 0 raised KeyboardInterrupt"}
    (missing,) = result["unpaired"]
    assert missing["trace"] == "A" and missing["at_end"]


def test_a_run_that_raised_never_agrees_even_with_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing() -> None:
        train(3)
        raise RuntimeError("Trying to resize storage that is not resizable")

    for name in ("a.trace", "b.trace"):
        with pytest.raises(RuntimeError):
            record(tmp_path / name, failing)
    status = main(["compare", str(tmp_path / "a.trace"), str(tmp_path / "b.trace")])
    out = capsys.readouterr().out
    assert status == 1
    assert "A's run did not run to its end: rank 0 raised RuntimeError: Trying to resize" in out
    assert "AGREE" not in out


def test_an_op_after_the_last_step_in_b_only_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", lambda: train(5))
    b = record(tmp_path / "b.trace", lambda: train(5, scale_after=True))
    status, result = compare(a, b, capsys)
    assert status == 1 and not result["agree"]
    (extra,) = result["unpaired"]
    assert extra["trace"] == "B" and extra["ops"] == 1 and extra["op"] == "aten::mul_.Tensor"
    where = f"{Path(__file__).name}:{_line_of('mul_(1.5)')}"
    assert extra["source"].endswith(f"{where} [parameter Sequential.0.weight]")


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(lines, start=1) if text in line)


@pytest.mark.parametrize(
    ("make_a", "make_b", "shapes"),
    [
        (lambda: torch.randn(10) * 2, lambda: torch.randn(11) * 2, ("[10]", "[11]")),
        (
            lambda: torch.nn.functional.log_softmax(torch.ones(4, 8), dim=-1),
            lambda: torch.nn.functional.log_softmax(torch.ones(4, 9), dim=-1),
            ("[4, 8]", "[4, 9]"),
        ),
        (
            # The constants cat reads are rows of their own where first read: the second
            # one, asked for another shape, is where the count first differs.
            lambda: torch.cat([torch.ones(3, 2), torch.ones(2, 2)]) * 3,
            lambda: torch.cat([torch.ones(3, 2), torch.ones(3, 2)]) * 3,
            ("[2, 2]", "[3, 2]"),
        ),
    ],
)
def test_another_element_count_is_a_difference_at_the_op_that_made_it(
    make_a: Callable[[], torch.Tensor],
    make_b: Callable[[], torch.Tensor],
    shapes: tuple[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch.manual_seed(0)
    a = record(tmp_path / "a.trace", make_a)
    torch.manual_seed(0)
    b = record(tmp_path / "b.trace", make_b)
    status, result = compare(a, b, capsys)
    assert status == 1
    origin = result["origin"]
    assert origin["kind"] == "origin"
    assert origin["difference"] == f"shape {shapes[0]} in A, {shapes[1]} in B"
    assert all(entry["index"] >= origin["index"] for entry in result["past_tolerance"])


SWAPS = 2000


def _swapped(generator: np.random.Generator, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An output of a drawn shape and the same with two of its elements swapped."""
    dims = int(generator.integers(1, 4))
    size = int(generator.choice([2, 3, 17, 64, 1000, 9000, 20000]))
    shape = [1] * dims
    for _ in range(int(np.log2(size)) + 1):
        shape[int(generator.integers(dims))] *= 2
    shape[-1] = max(2, size // max(1, int(np.prod(shape[:-1]))))
    count = int(np.prod(shape))
    while True:
        if kind == "float32":
            values = torch.from_numpy(generator.standard_normal(count).astype(np.float32))
        elif kind == "int64":
            values = torch.from_numpy(generator.integers(-5, 5, count))
        else:
            values = torch.from_numpy(generator.integers(0, 2, count).astype(bool))
        first, second = (int(i) for i in generator.choice(count, 2, replace=False))
        # Floats that differ by at least 0.5: the swap is above float32's tolerance in any
        # of these sizes; integers and bools that differ at all.
        if abs(float(values[first]) - float(values[second])) >= (0.5 if kind == "float32" else 1):
            break
    swapped = values.clone()
    swapped[first], swapped[second] = values[second], values[first]
    return values.reshape(shape), swapped.reshape(shape)


def test_two_thousand_swaps_of_two_elements_are_each_past_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generator = np.random.default_rng(20261205)
    pairs = [_swapped(generator, ("float32", "int64", "bool")[n % 3]) for n in range(SWAPS)]

    def run(side: int) -> None:
        for pair in pairs:
            value = pair[side]
            # An op that makes a new output holding the same values: the one recorded.
            torch.bitwise_or(value, value) if value.dtype == torch.bool else value.add(0)

    a = record(tmp_path / "a.trace", lambda: run(0))
    b = record(tmp_path / "b.trace", lambda: run(1))
    status, result = compare(a, b, capsys)
    assert status == 1 and result["ops"][0]["b"] == SWAPS
    assert sorted(entry["index"] for entry in result["past_tolerance"]) == list(range(SWAPS))
    assert {entry["kind"] for entry in result["past_tolerance"]} == {"origin"}
    said = [entry["difference"] for entry in sorted(result["past_tolerance"], key=index_of)]
    # Integers and bools: their own bits differ; floats: the data they read (made before
    # the recording) is other bits, which its digest as read says.
    assert said == [
        ("int64 values differ", "bool values differ")[n % 3 - 1] if n % 3 else UNSEEN_ADVICE
        for n in range(SWAPS)
    ]


def index_of(entry: dict[str, Any]) -> int:
    return int(entry["index"])


def test_every_two_rows_of_an_output_swapped_are_seen() -> None:
    values = torch.randn(64, 16)
    row = statistics(values)
    assert row is not None
    for first in range(64):
        for second in range(first + 1, 64, 7):
            swapped = values.clone()
            swapped[[first, second]] = values[[second, first]]
            other = statistics(swapped)
            assert other is not None
            truth = float((values - swapped).norm() / values.norm())
            estimate = float(detctx._compare.sketch.relative_difference(row, other))
            assert estimate > truth / 3


# Values below float32's atol (1e-30 RMS per element) count as zeros, by design.
@pytest.mark.parametrize("magnitude", [1e20, 1e35, 1e-20, 1e-25])
def test_large_and_tiny_float32_values_are_compared_as_any_others(
    magnitude: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = (torch.rand(20_000) + 0.5) * magnitude
    scaled = values * 1.5
    assert torch.isfinite(scaled).all() and (values > 0).all()
    a = record(tmp_path / "a.trace", lambda: values.add(0))
    b = record(tmp_path / "b.trace", lambda: scaled.add(0))
    same = record(tmp_path / "same.trace", lambda: values.add(0))
    status, result = compare(a, b, capsys)
    assert status == 1 and result["origin"]["index"] == 0
    assert 0.2 < result["origin"]["error"] < 0.5  # ||0.5 a|| / ||1.5 a|| = 1/3
    assert main(["compare", str(a), str(same)]) == 0
    row = statistics(values)
    assert row is not None and np.isfinite(row).all()
    assert np.isclose(row[6], float(values.double().norm()), rtol=1e-5)


def _crafted(path: Path, change: Callable[[np.ndarray], None]) -> None:
    """A trace of one op whose output's statistics ``change`` edits before they are
    written: the writer computes the CRCs, as someone editing the file would."""
    writer = TraceWriter(
        path, lambda: {"environment": {}, "rank": 0, "run": "crafted", "world_size": 1}
    )
    row = statistics(torch.linspace(-1.0, 2.0, 100))
    assert row is not None
    change(row)
    where = (writer.string("aten::add.Tensor"), writer.string(""), writer.string("x.py:1"), 1, 1)
    writer.add(where, 1, [(writer.string("float32"), writer.string("[100]"), 1, row)], [])
    writer.close()


def _set(column: int, value: float) -> Callable[[np.ndarray], None]:
    def change(row: np.ndarray) -> None:
        row[column] = value

    return change


def _swap_min_max(row: np.ndarray) -> None:
    row[3], row[4] = row[4], row[3]


@pytest.mark.parametrize(
    "change",
    [
        _set(3, float("nan")),
        _set(6, float("nan")),
        _set(6, float("inf")),
        _set(10, float("inf")),
        _swap_min_max,
        _set(5, 7.0),  # a mean above the max
        _set(6, 0.5),  # a norm below the largest value
        _set(6, 1e9),  # a norm no 100 values of at most 2 can have
        _set(0, 101.0),  # an element count its shape does not have
        _set(12, 1e6),  # a sketch number past its bound
        _set(7, -1.0),  # a count of zeros that is not a count
        _set(7, 2.5),
        _set(7, 101.0),  # more zeros than values
        _set(7, 100.0),  # every value zero, yet min and max are not
    ],
)
def test_a_crafted_trace_with_impossible_statistics_is_refused(
    change: Callable[[np.ndarray], None], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _crafted(tmp_path / "fine.trace", lambda row: None)
    assert len(read_trace(tmp_path / "fine.trace")) == 1
    _crafted(tmp_path / "crafted.trace", change)
    with pytest.raises(detctx.TraceError, match=r"crafted\.trace: an output whose"):
        read_trace(tmp_path / "crafted.trace")
    assert main(["compare", str(tmp_path / "fine.trace"), str(tmp_path / "crafted.trace")]) == 2
    assert "crafted.trace" in capsys.readouterr().err


def test_an_edited_header_is_refused_by_its_checksum(tmp_path: Path) -> None:
    path = record(tmp_path / "a.trace", lambda: train(2))
    data = path.read_bytes()
    edited = data.replace(b'"rank": 0', b'"rank": 1', 1)
    assert edited != data
    path.write_bytes(edited)
    with pytest.raises(detctx.TraceError, match="a header whose CRC does not match"):
        read_trace(path)


def test_integer_outputs_are_compared_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = torch.tensor([5, 0, 3, 2])
    a = record(tmp_path / "a.trace", lambda: torch.bincount(torch.tensor([0, 0, 2, 3, 3, 2])))
    b = record(tmp_path / "b.trace", lambda: torch.bincount(torch.tensor([0, 0, 2, 3, 3, 3])))
    del counts
    status, result = compare(a, b, capsys)
    assert status == 1
    assert result["origin"]["op"] == "aten::bincount"
    assert result["origin"]["difference"] == "int64 values differ"


def _ranks(folder: Path, run: str, world: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each rank of a ``world``-rank run recorded in this process, as torchrun's would be."""
    monkeypatch.setenv("DETCTX_RECORD_RUN", run)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        record(folder, lambda: train(2))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("DETCTX_RECORD_RUN")
    return folder


def test_a_folder_missing_a_rank_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _ranks(tmp_path / "a", "run-a", 2, monkeypatch)
    b = _ranks(tmp_path / "b", "run-b", 2, monkeypatch)
    assert main(["compare", str(a), str(b)]) == 0
    capsys.readouterr()
    (b / "rank1.trace").unlink()
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "ranks [0] of a run of 2 ranks: rank1.trace is missing" in err


def test_a_folder_mixing_two_runs_ranks_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _ranks(tmp_path / "a", "run-a", 2, monkeypatch)
    b = _ranks(tmp_path / "b", "run-b", 2, monkeypatch)
    (b / "rank1.trace").replace(a / "rank1.trace")
    (b / "rank0.trace").replace(tmp_path / "keep.trace")
    _ranks(b, "run-c", 2, monkeypatch)
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "mixes the traces of several recorded runs" in err
    assert "ranks [0] of run run-a; ranks [1] of run run-b" in err


def test_runs_of_other_world_sizes_do_not_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _ranks(tmp_path / "a", "run-a", 2, monkeypatch)
    b = _ranks(tmp_path / "b", "run-b", 4, monkeypatch)
    status, result = compare(a, b, capsys)
    assert status == 1 and not result["agree"]
    assert result["ranks_only"] == {"B": [2, 3]} and result["past_tolerance"] == []


@pytest.mark.slow
def test_a_small_trace_compares_in_a_process_with_two_gb_of_address_space(
    tmp_path: Path,
) -> None:
    a = record(tmp_path / "a.trace", lambda: torch.ones(3).add(1))
    assert a.stat().st_size < 4096

    def limited(then: str) -> subprocess.CompletedProcess[str]:
        script = textwrap.dedent(
            f"""
            import resource, sys
            resource.setrlimit(resource.RLIMIT_AS, (2_000_000 * 1024, 2_000_000 * 1024))
            import torch
            {then}
            """
        )
        return subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    if limited("pass").returncode != 0:
        # torch 2.1's wheel maps its CUDA libraries when imported, past 2 GB by itself.
        pytest.skip("this torch build cannot be imported under 2 GB of address space")
    done = limited(
        f"from detctx._cli import main; sys.exit(main(['compare', {str(a)!r}, {str(a)!r}]))"
    )
    assert done.returncode == 0, done.stderr
    assert "AGREE bit for bit" in done.stdout


def test_an_output_of_zeros_has_the_relative_tolerance_not_a_huge_one(tmp_path: Path) -> None:
    a = record(tmp_path / "a.trace", lambda: (torch.zeros(5).add(0), torch.ones(5).mul(3)))
    b = record(tmp_path / "b.trace", lambda: (torch.zeros(5).add(0), torch.ones(5).mul(4)))
    result = detctx.compare_traces(a, b)
    rank = result.ranks[0]
    # Each constant is a row where first read (a READ_OP), then the op reading it.
    names = [rank.b.text(number) for number in rank.b.ops["op"]]
    assert names == [READ_OP, "aten::add.Tensor", READ_OP, "aten::mul.Tensor"]
    zeros, changed = rank.tolerance[1], rank.tolerance[3]
    assert zeros == pytest.approx(3e-4) and changed < 1e-3
    assert result.origin is not None and result.origin.index == 3


def test_an_absolute_tolerance_with_no_relative_one_still_compares_floats_by_it(
    tmp_path: Path,
) -> None:
    values = torch.linspace(0.0, 1.0, 1000)
    moved = values + 1e-6
    a = record(tmp_path / "a.trace", lambda: values.add(0))
    b = record(tmp_path / "b.trace", lambda: moved.add(0))
    assert not detctx.compare_traces(a, b, rtol=0.0, atol=0.0).agree
    assert detctx.compare_traces(a, b, rtol=0.0, atol=1e-5).agree
    assert not detctx.compare_traces(a, b, rtol=0.0, atol=1e-7).agree


def _mlp(gelu: str, dropout_seed: int | None = None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(approximate=gelu),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(32, 1),
    )
    x = torch.randn(8, 16)
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    model(x).square().mean().backward()


def test_where_the_bits_first_part_from_the_same_inputs_is_named_within_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", lambda: _mlp("none"))
    b = record(tmp_path / "b.trace", lambda: _mlp("tanh"))
    status, result = compare(a, b, capsys)
    # A GELU in its tanh form is within float32's tolerance here, yet the op is named: where
    # the bits part, and as the origin by its argument.
    first = result["bits_part"][0]
    assert first["op"] == "aten::gelu" and first["module_path"] == "Sequential.3"
    assert first["backward"] is None and not first["random"]
    assert first["error"] <= first["tolerance"]
    assert status == 1 and not result["agree"] and not result["bitwise"]
    assert result["origin"]["index"] == first["index"]
    assert result["origin"]["difference"] == "approximate (not given) in A, 'tanh' in B"
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"bits first part: rank 0, op {first['index']} aten::gelu in Sequential.3" in out
    assert "its inputs are the same bits in A and B, its outputs are not" in out


def test_a_random_op_that_draws_differently_from_the_same_inputs_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", lambda: _mlp("none", dropout_seed=1))
    b = record(tmp_path / "b.trace", lambda: _mlp("none", dropout_seed=2))
    status, result = compare(a, b, capsys)
    assert status == 1
    origin = result["origin"]
    assert origin["op"] == "aten::bernoulli_.float" and origin["module_path"] == "Sequential.4"
    assert "the generators draw differently" in origin["difference"]
    assert result["bits_part"][0]["index"] == origin["index"]
    assert result["bits_part"][0]["random"]


def _adamw(bias_lr: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    others = [p for name, p in model.named_parameters() if name != "2.bias"]
    optimiser = torch.optim.AdamW(
        [{"params": others}, {"params": [model[2].bias], "lr": bias_lr}], lr=1e-2, foreach=False
    )
    data = torch.randn(3, 4, 8)
    for step in range(3):
        optimiser.zero_grad()
        model(data[step]).square().mean().backward()
        optimiser.step()


def _step_pre_hooks_run() -> bool:
    """Whether torch's global optimizer step pre-hooks run in this process: in torch 2.1,
    once anything was compiled, TorchDynamo replaces ``Optimizer.step`` and they no longer
    do (another test of this process may have compiled), so state tensors go unnamed."""
    from torch.optim import optimizer

    ran: list[bool] = []
    handle = optimizer.register_optimizer_step_pre_hook(lambda *_: ran.append(True))
    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).step()
    finally:
        handle.remove()
    return bool(ran)


def test_an_optimizer_op_is_named_by_the_parameter_it_updates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", lambda: _adamw(1e-2))
    trace = read_trace(a)
    sources = {trace.text(number) for number in trace.ops["source"].tolist()}
    assert any(source.endswith("[parameter Sequential.2.bias]") for source in sources)
    if _step_pre_hooks_run():
        assert any(source.endswith("[Sequential.0.weight: exp_avg]") for source in sources)
    b = record(tmp_path / "b.trace", lambda: _adamw(1.1e-2))
    status, result = compare(a, b, capsys)
    assert status == 1
    assert result["origin"]["source"].endswith("[parameter Sequential.2.bias]")
    assert result["origin"]["module_path"] == ""


class _Doubled(torch.autograd.Function):
    """x * 2, its backward scaled by ``factor`` (B's change)."""

    factor = 1.0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * (2 * _Doubled.factor)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = _Doubled.apply(self.lin(x))
        return result


def test_a_custom_autograd_functions_backward_is_named_at_the_module_that_called_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(path: Path, factor: float) -> Path:
        monkeypatch.setattr(_Doubled, "factor", factor)
        torch.manual_seed(0)
        net = torch.nn.Sequential(_Block(), torch.nn.Linear(4, 1))
        return record(path, lambda: net(torch.randn(3, 4)).sum().backward())

    a, b = run(tmp_path / "a.trace", 1.0), run(tmp_path / "b.trace", 1.01)
    origin = detctx.compare_traces(a, b).origin
    assert origin is not None and origin.backward == "_DoubledBackward"
    assert origin.module_path == "Sequential.0"  # was "(no module)"
    assert origin.source.endswith(f"{Path(__file__).name}:{_line_of('grad * (2 *')}")


def _on_a_numpy_batch(change: float = 0.0) -> Callable[[], None]:
    """A step on a batch made in NumPy (no recorded op made it: it has no row); ``change``
    added to one of its numbers."""

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    numbers = np.random.default_rng(3).standard_normal((8, 16)).astype(np.float32)
    numbers[2, 5] += change

    def step() -> None:
        model(torch.from_numpy(numbers)).square().mean().backward()

    return step


def test_an_op_reading_a_batch_no_recorded_op_made_is_named_where_the_bits_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A change of a third of the tolerance at the first layer's product, which reads the
    # batch: the batch's digest as read says both runs read the same bits there.
    from benchmarks.planting import Planter

    a = record(tmp_path / "a.trace", _on_a_numpy_batch())
    planter = Planter(0, "aten::addmm", "x(1+1e-4)")
    step = _on_a_numpy_batch()
    with planter:  # below the recorder: it records the changed output
        b = record(tmp_path / "b.trace", step)
    assert planter.planted_name == "aten::addmm"
    status, result = compare(a, b, capsys)
    assert status == 1 and result["agree"] is False
    first = result["bits_part"][0]
    assert (first["op"], first["module_path"]) == ("aten::addmm", "Sequential.0")
    assert first["error"] <= first["tolerance"]
    trace = read_trace(b)
    digests = trace.inputs["high"] | trace.inputs["low"]
    # Read twice, with the digest each time: by the product and by its weight's gradient.
    assert trace.inputs["op"][digests != 0].tolist() == [-1, -1]


def test_a_batch_that_differs_is_named_at_the_op_that_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace", _on_a_numpy_batch())
    b = record(tmp_path / "b.trace", _on_a_numpy_batch(change=1.0))
    status, result = compare(a, b, capsys)
    assert status == 1
    origin = result["origin"]
    assert (origin["op"], origin["module_path"]) == ("aten::addmm", "Sequential.0")
    assert origin["difference"] == UNSEEN_ADVICE
    assert not result["bits_part"]  # its inputs differ: not where the bits part
    assert main(["compare", str(a), str(b)]) == 1
    assert "whose bits differ from what A read here" in capsys.readouterr().out


def test_memory_an_op_only_writes_or_made_uninitialised_is_not_digested(
    tmp_path: Path,
) -> None:
    # out= and empty memory hold whatever was there: bits that differ between two runs of
    # one program, which must not read as data that differs.
    numbers = torch.from_numpy(np.arange(12, dtype=np.float32))

    def step() -> None:
        scratch = torch.empty(12)
        torch.mul(numbers, 2.0, out=scratch)
        scratch.add_(1.0)
        torch.add(numbers, 1.0, out=torch.empty(12))

    trace = read_trace(record(tmp_path / "a.trace", step))
    names = [trace.text(int(number)) for number in trace.ops["op"]]
    digested = trace.inputs["op"][(trace.inputs["high"] | trace.inputs["low"]) != 0]
    assert names == ["aten::mul.out", "aten::add_.Tensor", "aten::add.out"]
    assert digested.tolist() == [-1, -1]
