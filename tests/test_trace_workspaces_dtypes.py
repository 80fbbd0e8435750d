"""Two runs that compute the same agree, and one that computes in another dtype is named.

Kernels that return scratch memory beside their values (the CPU recurrent
layers' workspace, ``ctc_loss``'s forward variables past each sequence) must
not make two identical runs differ; a value that one run computes in
bfloat16 and the other in float32 (autocast on one side) is a change, caught
at the op where it enters, with both dtypes named.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import detctx
from detctx._compare.reading import read_trace
from detctx._locate import op_info

LSTM_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    gru = nn.GRU(16, 8, batch_first=True)
    # Scratch memory left dirty by other work, as in any real program.
    for size in (1000, 30000, 70000):
        torch.empty(size).uniform_(-1e6, 1e6)
    out, _ = model(torch.randn(4, 6, 8))
    out, _ = gru(out)
    out.sum().backward()
    """
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _outputs(path: Path, name: str) -> list[list[str]]:
    """The dtypes of every recorded output of each op called ``name``."""
    trace = read_trace(path)
    found = []
    for index in range(len(trace)):
        if trace.text(trace.ops[index]["op"]) == name:
            first, count = int(trace.first_value[index]), int(trace.ops[index]["outputs"])
            values = trace.values[first : first + count]
            found.append([trace.text(value["dtype"]) for value in values])
    return found


def test_the_recurrent_workspace_and_ctc_scratch_are_not_recorded(tmp_path: Path) -> None:
    assert op_info(torch.ops.aten.mkldnn_rnn_layer.default).kept == 3
    path = tmp_path / "rnn.trace"
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, batch_first=True)
    logits = torch.randn(6, 2, 5, requires_grad=True)
    with detctx.recording(path):
        lstm(torch.randn(2, 3, 4))[0].sum().backward()
        loss = nn.functional.ctc_loss(
            logits.log_softmax(2),
            torch.tensor([[1, 2, 2], [1, 3, 0]]),
            torch.tensor([6, 5]),
            torch.tensor([3, 2]),
        )
        loss.backward()
    layers = _outputs(path, "aten::mkldnn_rnn_layer")
    assert layers == [["float32"] * 3]  # output, last hidden and cell state; no uint8 workspace
    assert _outputs(path, "aten::_ctc_loss.Tensor") == [["float32"]]


@pytest.mark.slow
def test_two_processes_recording_recurrent_layers_agree_bit_for_bit(tmp_path: Path) -> None:
    script = tmp_path / "rnn.py"
    script.write_text(LSTM_SCRIPT)
    for name in ("a.trace", "b.trace"):
        command = ["record", "-o", str(tmp_path / name), "--", sys.executable, str(script)]
        done = subprocess.run(
            [sys.executable, "-m", "detctx", *command],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
    result = detctx.compare_traces(tmp_path / "a.trace", tmp_path / "b.trace")
    assert result.bitwise and result.agree, result.past_tolerance[:3]


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _step(path: Path, bfloat16: bool) -> None:
    torch.manual_seed(0)
    model = _Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    with detctx.recording(path):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        loss.backward()
        optimizer.step()


def test_a_value_one_run_computes_in_bfloat16_is_the_origin_with_both_dtypes_named(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "float32.trace", tmp_path / "bfloat16.trace"
    _step(a, bfloat16=False)
    _step(b, bfloat16=True)
    result = detctx.compare_traces(a, b)
    assert not result.agree
    origin = result.origin
    assert origin is not None and origin.kind == "origin"
    assert origin.dtypes == ("float32", "bfloat16")
    assert origin.module_path == "_Mlp.up"  # where the first value is rounded
    assert origin.error > origin.tolerance
    assert "float32 in A, bfloat16 in B" in result.format()
    # Ops past tolerance after it, of either dtype, are measured at float32's tolerance.
    assert all(entry.index >= origin.index for entry in result.past_tolerance)
    # The same step in bfloat16 twice: the dtypes agree, nothing is named.
    again = tmp_path / "again.trace"
    _step(again, bfloat16=True)
    same = detctx.compare_traces(b, again)
    assert same.bitwise and all(entry.dtypes is None for entry in same.past_tolerance)


def test_code_compiled_with_torch_compile_is_recorded_op_by_op_and_compiles_after(
    tmp_path: Path,
) -> None:
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.testing import CompileCounter
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    # The "eager" backend compiles through TorchDynamo without a C++ toolchain.
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(4, 16))  # compiled before the recording
    twice = torch.compile(lambda x: (x * 2).sin(), backend="eager")
    path = tmp_path / "compiled.trace"
    with detctx.recording(path):
        compiled(torch.randn(8, 16)).sum().backward()
        twice(torch.randn(4))
    trace = read_trace(path)
    names = [trace.text(trace.ops[index]["op"]) for index in range(len(trace))]
    assert names.count("aten::addmm") == 2 and "aten::threshold_backward" in names
    assert "aten::sin" in names
    assert dynamo.config.disable is False  # compiling is back on
    dynamo.reset()
    counter = CompileCounter()
    torch.compile(lambda x: x.cos() + 1, backend=counter)(torch.randn(3))
    assert counter.frame_count == 1  # compiled, not run eagerly


COMPILED_LATER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch, detctx
    from detctx._compare.reading import read_trace
    assert "torch._dynamo" not in sys.modules
    path = Path(sys.argv[1])
    with detctx.recording(path):
        twice = torch.compile(lambda x: (x * 2).sin(), backend="eager")
        twice(torch.randn(4))
    import torch._dynamo.config as config
    trace = read_trace(path)
    print(sorted({trace.text(trace.ops[i]["op"]) for i in range(len(trace))}))
    print(config.disable, os.environ.get("TORCH_COMPILE_DISABLE"))
    """
)


@pytest.mark.slow
def test_code_first_compiled_while_recording_runs_eagerly_and_nothing_is_left_changed(
    tmp_path: Path,
) -> None:
    script = tmp_path / "later.py"
    script.write_text(COMPILED_LATER)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "later.trace")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    ops, switches = done.stdout.splitlines()[-2:]
    assert "'aten::sin'" in ops and "'aten::mul.Tensor'" in ops
    assert switches == "False None"


def test_a_trace_without_ops_compares_with_nothing(tmp_path: Path) -> None:
    empty, full = tmp_path / "empty.trace", tmp_path / "full.trace"
    with detctx.recording(empty):
        pass
    with detctx.recording(full):
        torch.ones(3).add(1)
    for a, b in ((empty, empty), (empty, full), (full, empty)):
        with pytest.raises(detctx.TraceError, match=r"holds? no op"):
            detctx.compare_traces(a, b)


def _masked_attention(path: Path, scale: float, batch: int) -> None:
    torch.manual_seed(0)
    q, k = torch.randn(batch, 8, 16), torch.randn(batch, 8, 16)
    mask = torch.ones(8, 8).tril() == 0
    with detctx.recording(path):
        scores = (q @ k.transpose(1, 2)).masked_fill(mask, float("-inf"))
        scaled = scores * scale  # where B's change enters: a tensor holding -inf
        scaled.softmax(-1).sum().item()


@pytest.mark.parametrize("batch", [2, 200])  # summarised in NumPy, and in torch
def test_a_change_in_a_tensor_holding_minus_inf_is_the_origin_there(
    tmp_path: Path, batch: int
) -> None:
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    _masked_attention(a, 0.25, batch)
    _masked_attention(b, 0.25 * 1.003, batch)
    result = detctx.compare_traces(a, b)
    origin = result.origin
    assert origin is not None and origin.op == "aten::mul.Tensor", origin
    assert origin.error == pytest.approx(0.003, rel=0.5)
    same = tmp_path / "same.trace"
    _masked_attention(same, 0.25, batch)
    assert detctx.compare_traces(a, same).bitwise


def test_the_switch_a_recording_sets_is_not_an_environment_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As in a process that has not loaded TorchDynamo: the recording sets the variable.
    monkeypatch.delitem(sys.modules, "torch._dynamo.config", raising=False)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    first = tmp_path / "first.trace"
    with detctx.recording(first):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"
        torch.ones(3).add(1)
    assert "TORCH_COMPILE_DISABLE" not in os.environ
    monkeypatch.undo()  # TorchDynamo loaded (if this process has): its switch is set
    second = tmp_path / "second.trace"
    with detctx.recording(second):
        torch.ones(3).add(1)
    assert "env.TORCH_COMPILE_DISABLE" not in read_trace(first).environment
    assert detctx.compare_traces(first, second).environment_differences == {}
