"""A recorded window of optimizer steps: only its steps' ops, after the state it starts
from, so two windows that start from different states say so and name the tensors, and two
windows resumed from one checkpoint name the op where they part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import detctx
from detctx._cli import main
from detctx._compare.format import STATE_OP
from detctx._compare.reading import read_trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Net(torch.nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16, eps=eps)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def build(eps: float = 1e-5) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net(eps)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


DATA = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1))


def train(net: Net, optimiser: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimiser.zero_grad()
        net(DATA[step]).square().mean().backward()
        optimiser.step()


def record(path: Path, body: Callable[[], object], steps: Any = None) -> Path:
    with detctx.recording(path, steps=steps):
        body()
    return path


def compare(a: Path, b: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, Any]:
    status = main(["compare", str(a), str(b), *extra])
    out = capsys.readouterr().out
    return status, json.loads(out) if "--json" in extra else out


def test_a_window_records_only_its_steps_after_the_state_it_starts_from(
    tmp_path: Path, steps_counted: None
) -> None:
    whole = record(tmp_path / "whole.trace", lambda: train(*build(), range(8)))
    window = record(tmp_path / "window.trace", lambda: train(*build(), range(8)), "6:8")
    ops, windowed = read_trace(whole), read_trace(window)
    names = [windowed.text(number) for number in windowed.ops["op"]]
    state = [number for number, name in enumerate(names) if name == STATE_OP]
    # The state first: 6 parameters, their AdamW state (exp_avg, exp_avg_sq, step each).
    assert state == list(range(6 + 3 * 6))
    sources = [windowed.text(windowed.ops["source"][number]) for number in state]
    assert "[parameter Net.norm.weight]" in sources and "[Net.out.bias: exp_avg_sq]" in sources
    # Steps 6 and 7, nothing else (the program's ops; detctx's rows of data no op made,
    # where first read, are the batch's, each step in both).
    program = [name for name in names if not name.startswith("detctx::")]
    whole = [ops.text(number) for number in ops.ops["op"]]
    per_step = len([name for name in whole if not name.startswith("detctx::")]) // 8
    assert len(program) == 2 * per_step


def test_windows_that_start_from_different_states_say_so_and_name_the_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps_counted: None
) -> None:
    # B's LayerNorm has another eps from step 0; both record steps 6 and 7 only.
    a = record(tmp_path / "a.trace", lambda: train(*build(), range(8)), (6, 8))
    b = record(tmp_path / "b.trace", lambda: train(*build(eps=1e-2), range(8)), range(6, 8))
    status, text = compare(a, b, capsys)
    assert status == 1
    assert "traces DIFFER: the recordings start from different states" in text
    assert "the recordings started from different states:" in text
    assert "parameter Net.inp.weight" in text  # named, not "op 0"
    status, result = compare(a, b, capsys, "--json")
    assert result["origin"]["op"] == STATE_OP
    assert result["bits_part"] == []  # no op computed the state: nothing parts "from inputs"


def test_windows_resumed_from_one_checkpoint_name_the_op_where_they_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net, optimiser = build()
    train(net, optimiser, range(6))
    checkpoint = {"net": net.state_dict(), "optimiser": optimiser.state_dict()}

    def resumed(eps: float) -> None:
        again, again_optimiser = build()
        again.load_state_dict(checkpoint["net"])
        again_optimiser.load_state_dict(checkpoint["optimiser"])
        again.norm.eps = eps  # B's change, in the steps recorded
        train(again, again_optimiser, range(6, 8))

    a = record(tmp_path / "a.trace", lambda: resumed(1e-5), "0:2")
    b = record(tmp_path / "b.trace", lambda: resumed(1e-2), "0:2")
    status, result = compare(a, b, capsys, "--json")
    assert status == 1
    assert result["origin"]["op"] == "aten::native_layer_norm"
    assert result["origin"]["module_path"] == "Net.norm"


def test_windows_of_the_same_run_from_one_state_agree_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps_counted: None
) -> None:
    a = record(tmp_path / "a.trace", lambda: train(*build(), range(8)), "3:5")
    b = record(tmp_path / "b.trace", lambda: train(*build(), range(8)), "3:5")
    status, result = compare(a, b, capsys, "--json")
    assert status == 0 and result["agree"] and result["bitwise"]


@pytest.mark.parametrize(
    "steps",
    ["6", "8:6", "3:3", "-1:2", "a:b", " 1:2:3", (1,), (1.0, 2), (True, 2), range(0, 8, 2), 5],
)
def test_a_window_that_is_not_a_range_of_steps_is_refused_before_anything_is_written(
    steps: Any, tmp_path: Path
) -> None:
    target = tmp_path / "a.trace"
    with pytest.raises(detctx.TraceError, match=r"'A:B' .* 0 <= A < B"):
        with detctx.recording(target, steps=steps):
            pass
    assert not target.exists()


def test_detctx_record_records_the_window_it_is_given(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
            optimiser = torch.optim.SGD(net.parameters(), lr=0.1)
            for _ in range(4):
                optimiser.zero_grad()
                net(torch.ones(2, 4)).sum().backward()
                optimiser.step()
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def record_steps(steps: str, name: str, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "detctx",
                "record",
                "--steps",
                steps,
                "-o",
                str(tmp_path / name),
                "--",
                *command,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    done = record_steps("2:3", "w.trace", sys.executable, str(script))
    assert done.returncode == 0, done.stderr
    trace = read_trace(tmp_path / "w.trace")
    names = [trace.text(number) for number in trace.ops["op"]]
    assert names[:2] == [STATE_OP, STATE_OP]  # the weight and the bias entering step 2
    assert STATE_OP not in names[2:] and len(names) > 2
    refused = record_steps("5", "x.trace", "true")
    assert refused.returncode == 2 and "0 <= A < B" in refused.stderr
    assert not (tmp_path / "x.trace").exists()
    late = record_steps("10:12", "late.trace", sys.executable, str(script))
    assert late.returncode == 2
    assert "the window of steps 10:12 never opened" in late.stderr
    assert "fewer than 10 optimizer steps" in late.stderr


FSDP2_WINDOW = """
import os, socket, sys, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import fully_shard
import detctx
from detctx._compare.reading import read_trace
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
fully_shard(net)
optimiser = torch.optim.AdamW(net.parameters(), lr=1e-2)
with detctx.recording(sys.argv[1], steps="1:2"):
    for _ in range(3):
        optimiser.zero_grad()
        net(torch.randn(2, 4)).sum().backward()
        optimiser.step()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_window_of_an_fsdp2_run_starts_from_its_sharded_state_named(tmp_path: Path) -> None:
    fully_shard = getattr(torch.distributed, "fsdp", None)
    if fully_shard is None or not hasattr(fully_shard, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_WINDOW)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "w.trace")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    trace = read_trace(tmp_path / "w.trace")
    state = [
        trace.text(source)
        for op, source in trace.ops[["op", "source"]]
        if trace.text(op) == STATE_OP
    ]
    # The DTensor parameters (each rank's shard) and AdamW's state named after them.
    assert "[parameter FSDPSequential.0.weight]" in state
    assert "[FSDPSequential.2.bias: exp_avg_sq]" in state and len(state) == 4 + 4 * 3
