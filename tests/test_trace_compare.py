"""Across environments: record a step once, compare it with another environment's within
tolerance, and name the op where an error starts (not every op it reaches)."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import detctx
from detctx._cli import main
from detctx._compare.sketch import COLUMNS, SIGNS, relative_difference
from detctx._compare.stacked import statistics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import across as trace_gpt

HAS_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
SCALE_LINE = next(
    number
    for number, line in enumerate(Path(trace_gpt.__file__).read_text().splitlines(), start=1)
    if line.strip() == trace_gpt.SCALE_LINE
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def record(path: Path, **options: object) -> Path:
    with detctx.recording(path):
        trace_gpt.train(**options)  # type: ignore[arg-type]
    return path


def compare_json(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    status = main(["compare", str(a), str(b), "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_the_same_step_recorded_twice_agrees_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = record(tmp_path / "a.trace"), record(tmp_path / "b.trace")
    status, result = compare_json(a, b, capsys)
    assert status == 0
    assert result["agree"] and result["bitwise"]
    assert result["origin"] is None and result["past_tolerance"] == []
    assert result["environment_differences"] == {}


@pytest.mark.skipif(not HAS_FLASH, reason="this torch has no flash SDPA kernel on the CPU")
def test_flash_against_math_attention_agrees_within_tolerance_but_not_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "flash.trace")
    b = record(tmp_path / "math.trace", kernel="math")
    status, result = compare_json(a, b, capsys)
    assert status == 0, result["past_tolerance"][:3]
    assert result["agree"] and not result["bitwise"]
    partial = {entry["module_path"] for entry in result["partial_alignment"]}
    assert partial == {f"GPT.h.{layer}.attn" for layer in range(trace_gpt.LAYERS)}


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_a_multiply_in_one_mlp_is_the_origin_and_later_ops_inherit(
    kernel: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if kernel == "math" and not HAS_FLASH:
        pytest.skip("this torch has no flash SDPA kernel on the CPU")
    a = record(tmp_path / "a.trace")
    b = record(tmp_path / "b.trace", kernel=kernel, scale_layer=1)
    status, result = compare_json(a, b, capsys)
    assert status == 1 and not result["agree"]
    origin = result["origin"]
    assert origin["op"] == "aten::mul.Tensor"
    assert origin["module_path"] == "GPT.h.1.mlp"
    assert origin["source"].endswith(f"across.py:{SCALE_LINE}")
    assert origin["rank"] == 0 and origin["error"] > origin["tolerance"]
    later = [entry for entry in result["past_tolerance"] if entry["index"] > origin["index"]]
    assert len(later) > 100
    # Past the multiply, the error is inherited, but where the multiply runs again (its
    # backward: the gradient times 1.003; the next step): the change enters there too.
    again = [entry for entry in later if entry["kind"] == "origin"]
    assert {entry["source"] for entry in again} <= {origin["source"]}
    assert len(later) - len(again) > 100
    assert min(entry["index"] for entry in result["past_tolerance"]) == origin["index"]


def test_the_text_report_names_the_origin_and_the_plot_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    a = record(tmp_path / "a.trace")
    b = record(tmp_path / "b.trace", scale_layer=1)
    status = main(["compare", str(a), str(b), "--plot", str(tmp_path / "errors.png")])
    out = capsys.readouterr().out
    assert status == 1
    assert "origin: rank 0, op " in out and "aten::mul.Tensor in GPT.h.1.mlp" in out
    assert (tmp_path / "errors.png").stat().st_size > 10_000


def _with_environment(path: Path, **changes: str) -> None:
    """Rewrite a trace's header as another machine's would read (chunks stay as they are)."""
    data = path.read_bytes()
    magic, version, size, _ = struct.unpack_from("<8sIII", data)
    header = json.loads(data[20 : 20 + size])
    header["environment"].update(changes)
    text = json.dumps(header).encode()
    start = struct.pack("<8sIII", magic, version, len(text), zlib.crc32(text))
    path.write_bytes(start + text + data[20 + size :])


def test_another_torch_release_and_a_variable_set_in_b_only_are_environment_differences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = record(tmp_path / "a.trace")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    b = record(tmp_path / "b.trace")
    _with_environment(a, torch="2.1.2+cpu")
    status, result = compare_json(a, b, capsys)
    assert status == 0 and result["bitwise"]
    assert result["environment_differences"] == {
        "env.NCCL_ALGO": [None, "Ring"],
        "torch": ["2.1.2+cpu", torch.__version__],
    }


def test_traces_of_two_different_programs_cannot_be_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace")
    b = tmp_path / "b.trace"
    with detctx.recording(b):
        torch.nn.Conv2d(3, 8, 3)(torch.randn(2, 3, 16, 16)).relu().sum().backward()
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "record different programs" in err and str(a) in err


@pytest.mark.parametrize("damage", ["cut", "flipped", "header"])
def test_a_damaged_trace_stops_the_compare_with_the_file_named(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = record(tmp_path / "a.trace")
    b = tmp_path / "b.trace"
    data = bytearray(a.read_bytes())
    if damage == "cut":
        data = data[: len(data) // 2]
    elif damage == "flipped":
        data[len(data) // 2] ^= 0x10
    else:
        data[20] = ord("!")
    b.write_bytes(bytes(data))
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("detctx: error: trace ") and str(b) in err
    assert "Traceback" not in err
    with pytest.raises(detctx.TraceError, match=str(b)):
        detctx.compare_traces(a, b)


def test_compare_traces_returns_the_json_fields_as_an_object(tmp_path: Path) -> None:
    a = record(tmp_path / "a.trace")
    b = record(tmp_path / "b.trace", scale_layer=0)
    result = detctx.compare_traces(a, b)
    assert not result.agree and not result.bitwise
    assert result.origin is not None and result.origin.module_path == "GPT.h.0.mlp"
    assert isinstance(result.origin, detctx.OpError)
    assert result.origin.kind == "origin" and result.origin.error > result.origin.tolerance
    assert all(isinstance(entry, detctx.OpError) for entry in result.past_tolerance)
    fields = {"rank", "index", "op", "module_path", "source", "error", "tolerance", "kind"}
    assert fields <= set(result.as_dict()["origin"])
    assert set(result.as_dict()) >= {
        "agree",
        "bitwise",
        "origin",
        "past_tolerance",
        "environment_differences",
    }
    loose = detctx.compare_traces(a, b, rtol=0.1)
    assert loose.agree and loose.origin is None


def test_rounding_a_float32_tensor_to_bfloat16_is_past_the_default_tolerance(
    tmp_path: Path,
) -> None:
    x = torch.randn(64, 64)
    with detctx.recording(tmp_path / "a.trace"):
        (x @ x).tanh()
    with detctx.recording(tmp_path / "b.trace"):
        (x @ x).to(torch.bfloat16).to(torch.float32).tanh()
    result = detctx.compare_traces(tmp_path / "a.trace", tmp_path / "b.trace")
    assert not result.agree
    assert result.origin is not None and result.origin.op == "aten::_to_copy"


@pytest.mark.parametrize("seed", range(40))
def test_the_sketch_estimates_a_difference_within_its_stated_accuracy(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    size = int(torch.randint(1, 200_000, (), generator=generator))
    a = torch.randn(size, generator=generator)
    relative = 10.0 ** float(torch.empty(()).uniform_(-7, -1, generator=generator))
    b = a + relative * a.norm() / size**0.5 * torch.randn(size, generator=generator)
    # Differences spread over many elements: within about 9% (we allow 3 sigma).
    row_a, row_b = statistics(a.double()), statistics(b.double())
    assert row_a is not None and row_b is not None
    estimate = float(relative_difference(row_a, row_b)) * max(row_a[6], row_b[6])
    truth = float((a.double() - b.double()).norm())
    if size >= 4 * SIGNS * COLUMNS:
        assert abs(estimate / truth - 1) < 0.3
    # Any difference: within a factor of 3 (worst case: the same in every column).
    assert truth / 3 < estimate < truth * 3 or size < 64


def test_the_sketch_sees_a_change_in_one_element() -> None:
    a = torch.randn(1000)
    b = a.clone()
    b[637] += 1.0
    row_a, row_b = statistics(a), statistics(b)
    assert row_a is not None and row_b is not None
    # One element's difference is estimated within 0.79..1.23 of its size, whatever the draw.
    estimate = float(relative_difference(row_a, row_b)) * max(row_a[6], row_b[6])
    assert 0.79 < estimate < 1.23
    assert row_a[0] == 1000 and np.isclose(row_a[5], float(a.mean()), rtol=1e-5)
    assert np.isclose(row_a[6], float(a.norm()), rtol=1e-6)


def _crafted(
    path: Path, flows: list[list[tuple[int, int]]], digests: tuple[tuple[int, int], ...] = ()
) -> None:
    """A trace of one-output ops, op ``i`` reading ``flows[i]``, its last with ``digests``
    of inputs: what a writer never writes."""
    from detctx._compare.format import TraceWriter

    writer = TraceWriter(
        path, lambda: {"environment": {}, "rank": 0, "run": "crafted", "world_size": 1}
    )
    stats = statistics(torch.ones(4))
    assert stats is not None
    where = (writer.string("aten::add.Tensor"), writer.string(""), writer.string("x.py:1"), 1, 1)
    value = (writer.string("float32"), writer.string("[4]"), 1, stats)
    for number, inputs in enumerate(flows):
        writer.add(where, 0, [value], inputs, digests if number == len(flows) - 1 else ())
    writer.close()


@pytest.mark.parametrize(
    ("flows", "digests", "problem"),
    [
        ([[(0, 0)]], (), "an input said to come from an op that did not run before it"),
        ([[], [(1, 0)]], (), "an input said to come from an op that did not run before it"),
        ([[], [(0, 3)]], (), "an input said to be an output its producer does not have"),
        ([[], [(-2, 0)]], (), "an input said to come from an op that did not run before it"),
        ([[], [(0, 0)], [(-1, 0), (1, 0)]], ((1, 7),), "by a recorded op with a digest"),
    ],
)
def test_a_crafted_trace_whose_data_flow_points_nowhere_is_refused(
    flows: list[list[tuple[int, int]]],
    digests: tuple[tuple[int, int], ...],
    problem: str,
    tmp_path: Path,
) -> None:
    from detctx._compare.reading import read_trace

    path = tmp_path / "crafted.trace"
    # The digest of data no recorded op made, where an op reads it: written and read back.
    _crafted(tmp_path / "fine.trace", [[], [(0, 0)], [(1, 0), (-1, 0)]], ((1, 2**127 + 5),))
    fine = read_trace(tmp_path / "fine.trace")
    assert len(fine) == 3
    assert fine.inputs["high"].tolist() == [0, 0, 2**63] and fine.inputs["low"][2] == 5
    _crafted(path, flows, digests)
    with pytest.raises(detctx.TraceError, match=problem):
        read_trace(path)


OLDEST_TORCH_TRACE = Path(__file__).parent / "data" / "across-torch-2.1.2.trace"
"""examples/across.py's step recorded on torch 2.1.2 (CPU, one thread), as ``record`` does.

Made again when the example or the trace format changes, from the project's folder, in an
environment with torch 2.1.2 and this detctx installed: ``python -c "import sys, torch;
sys.path.insert(0, 'examples'); import across, detctx; torch.set_num_threads(1);
ctx = detctx.recording('tests/data/across-torch-2.1.2.trace'); ctx.__enter__();
across.train(); ctx.__exit__(None, None, None)"``.
"""


@pytest.mark.parametrize("scale_layer", [None, 1])
def test_a_trace_from_torch_2_1_compares_with_one_from_this_torch(
    scale_layer: int | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The oldest claimed release records the same step within tolerance of this one, and a
    # multiply added on this side is still the origin across the two releases.
    here = record(tmp_path / "here.trace", scale_layer=scale_layer)
    status, result = compare_json(OLDEST_TORCH_TRACE, here, capsys)
    releases = result["environment_differences"].get("torch", [torch.__version__])
    assert releases[0].startswith("2.1.2")  # no difference where this torch is 2.1.2 too
    if scale_layer is None:
        assert status == 0 and result["agree"], result["past_tolerance"][:3]
        assert result["origin"] is None
    else:
        assert status == 1
        assert result["origin"]["op"] == "aten::mul.Tensor"
        assert result["origin"]["module_path"] == "GPT.h.1.mlp"
