"""locate_divergence: the first op where two runs part, named by op, module and source line."""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import detctx
from detctx._locate.batch import Batch
from detctx._locate.recorder import OpRecorder
from detctx._locate.trace import OpRecord

HERE = Path(__file__).read_text(encoding="utf-8").splitlines()


def line_of(marker: str) -> str:
    """``test_locate.py:N`` for the line of this file that carries ``marker``."""
    numbers = [i + 1 for i, text in enumerate(HERE) if text.rstrip().endswith(marker)]
    assert len(numbers) == 1, marker
    return f"test_locate.py:{numbers[0]}"


def fresh_entropy() -> float:
    """A float in (0, 1] from 52 bits of OS entropy: two calls agree once in 2**52."""
    return (int.from_bytes(os.urandom(8), "little") % (1 << 52) + 1) / (1 << 52)


class Entropy(nn.Module):
    """Mixes fresh OS entropy into what passes through it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        jitter = fresh_entropy() / 1e3
        return x + jitter  # entropy mixed in


class Encoder(nn.Module):
    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), Entropy() if noisy else nn.Identity()])
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))  # each layer
        return self.drop(x)  # dropout draws


class Net(nn.Module):
    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.encoder = Encoder(noisy)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))  # the head


def train_step(noisy: bool = False) -> None:
    model = Net(noisy)
    loss = model(torch.randn(4, 6)).pow(2).mean()
    loss.backward()


def test_two_identical_runs_report_none():
    assert detctx.locate_divergence(train_step) is None
    assert detctx.locate_divergence(train_step, runs=3, seed=7) is None


def test_a_submodule_mixing_in_os_entropy_is_named_with_its_op_and_line():
    found = detctx.locate_divergence(train_step, noisy=True)

    assert found is not None
    assert found.reason == "values"
    assert found.op == "aten::add.Tensor"
    assert found.module_path == "Net.encoder.layers.1"
    assert found.source.endswith(line_of("# entropy mixed in"))
    assert (found.shape, found.dtype, found.device) == ((4, 6), "float32", "cpu")
    assert found.node == ""
    assert found.total == 24 and found.mismatched is not None and found.mismatched > 0
    assert found.max_abs_diff is not None and 0 < found.max_abs_diff < 0.01
    text = str(found)
    assert "aten::add.Tensor in module Net.encoder.layers.1" in text and found.source in text


def test_data_order_from_an_unseeded_generator_is_named_at_the_indexing_line():
    data = torch.arange(32, dtype=torch.float32).reshape(8, 4)

    def epoch() -> None:
        order = np.random.default_rng().permutation(8)  # OS entropy, not the seeded stream
        batch = data[torch.from_numpy(order[:4])]  # data order
        nn.Linear(4, 2)(batch).sum().backward()

    found = detctx.locate_divergence(epoch)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::index.Tensor"
    assert found.module_path == ""
    assert found.source.endswith(line_of("# data order"))


def test_an_extra_draw_made_outside_the_recorded_ops_is_reported_as_the_rng_stream():
    calls = []

    def prefetch_once_then_step() -> None:
        model = Net()
        if calls:
            # Another thread draws from the global generator: its op is not recorded.
            worker = threading.Thread(target=lambda: torch.rand(1))
            worker.start()
            worker.join()
        calls.append(1)
        model(torch.ones(4, 6)).sum().backward()

    found = detctx.locate_divergence(prefetch_once_then_step)

    assert found is not None and found.reason == "rng"
    assert found.op == "aten::bernoulli_.float"
    assert found.module_path == "Net.encoder.drop"
    assert found.source.endswith(line_of("# dropout draws"))
    assert "the RNG stream differed before this op" in str(found)


class NoisyGradient(torch.autograd.Function):
    """Exact in the forward pass; the backward pass adds OS entropy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        jitter = 1.0 + fresh_entropy() / 1e3
        return grad * jitter  # backward-only entropy


class Scaler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NoisyGradient.apply(x)  # type: ignore[no-untyped-call,no-any-return]


def test_a_divergence_only_in_the_backward_pass_names_the_backward_op():
    def step() -> None:
        model = nn.Sequential(nn.Linear(3, 3), Scaler(), nn.Linear(3, 1))
        out = model(torch.randn(2, 3)).sum()
        out.backward()

    found = detctx.locate_divergence(step)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::mul.Tensor"
    assert found.node == "NoisyGradientBackward"
    assert found.source.endswith(line_of("# backward-only entropy"))
    assert "in the backward pass (NoisyGradientBackward)" in str(found)


def test_a_builtin_backward_op_is_named_by_the_forward_module_and_line():
    ops: list[OpRecord] = []

    class Keep:
        def add_batch(self, batch: Batch) -> None:
            ops.extend(batch.records())

    model = Net()
    recorder = OpRecorder(Keep())
    recorder.start()
    try:
        model(torch.randn(2, 6)).sum().backward()
    finally:
        recorder.stop()

    backward = {(op.module_path, op.source) for op in ops if op.node == "AddmmBackward0"}
    assert {(module, source.rpartition("/")[2]) for module, source in backward} == {
        ("Net.head", line_of("# the head")),
        ("Net.encoder.layers.0", line_of("# each layer")),
    }


def test_a_dataloader_with_worker_processes_inside_the_recorded_function_agrees():
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(48, dtype=torch.float32).reshape(12, 4))

    def epoch() -> None:
        loader = DataLoader(
            data, batch_size=4, shuffle=True, num_workers=2, generator=detctx.loader_generator()
        )
        layer = nn.Linear(4, 1)
        for (batch,) in loader:
            layer(batch).sum().backward()

    assert detctx.locate_divergence(epoch) is None


def test_different_control_flow_is_reported_as_different_ops():
    calls = []

    def step() -> None:
        calls.append(1)
        x = torch.ones(3)
        y = x.exp() if len(calls) == 1 else x.sin()  # branch on a counter
        y.sum()

    found = detctx.locate_divergence(step)

    assert found is not None and found.reason == "op"
    assert found.op == "aten::sin" and "aten::exp" in found.reference
    assert found.source.endswith(line_of("# branch on a counter"))


def test_a_run_that_stops_early_is_reported_as_ended():
    calls = []

    def step() -> None:
        calls.append(1)
        torch.ones(2).exp()
        if len(calls) == 1:
            torch.ones(2).cos()

    found = detctx.locate_divergence(step)

    assert found is not None and found.reason == "ended"
    assert "run 2 ended after" in str(found)


def test_check_reproducible_with_locate_puts_the_op_in_its_message():
    def noisy_forward() -> torch.Tensor:
        model = Net(noisy=True)
        return model(torch.randn(4, 6)).detach()

    with pytest.raises(detctx.NotReproducibleError) as raised:
        detctx.check_reproducible(noisy_forward, locate=True)

    message = str(raised.value)
    assert "aten::add.Tensor in module Net.encoder.layers.1" in message
    assert line_of("# entropy mixed in") in message


def test_check_reproducible_without_locate_records_nothing():
    with pytest.raises(detctx.NotReproducibleError) as raised:
        detctx.check_reproducible(lambda: torch.tensor(fresh_entropy()))
    assert "parted" not in str(raised.value)


def test_recording_is_off_unless_asked_for_and_leaves_no_hooks_behind():
    from torch.nn.modules import module as torch_module

    hooks = (
        dict(torch_module._global_forward_pre_hooks),
        dict(torch_module._global_forward_hooks),
    )
    with detctx.deterministic(seed=1):
        train_step()
    detctx.locate_divergence(train_step)

    assert dict(torch_module._global_forward_pre_hooks) == hooks[0]
    assert dict(torch_module._global_forward_hooks) == hooks[1]
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_callers_rng_state_is_left_alone():
    torch.rand(3)
    before = detctx.fingerprint()
    detctx.locate_divergence(train_step)
    assert detctx.fingerprint() == before


def test_an_error_in_the_function_propagates_and_recording_stops():
    def broken() -> None:
        Net()(torch.randn(2, 6))
        raise KeyError("boom")

    with pytest.raises(KeyError):
        detctx.locate_divergence(broken)
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize(
    ("arguments", "error", "text"),
    [
        ({"fn": 3}, TypeError, "fn must be callable"),
        ({"runs": 1}, ValueError, "at least 2"),
        ({"runs": True}, TypeError, "runs must be an integer"),
        ({"seed": -1}, ValueError, "seed"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    arguments: dict[str, Any], error: type[Exception], text: str
):
    ran = []
    fn = arguments.pop("fn", lambda: ran.append(1))
    with pytest.raises(error, match=text):
        detctx.locate_divergence(fn, **arguments)
    assert ran == []


def test_check_reproducible_with_locate_says_when_only_the_result_differed():
    with pytest.raises(detctx.NotReproducibleError) as raised:
        detctx.check_reproducible(fresh_entropy, locate=True)
    message = str(raised.value)
    assert "returned another result than run 1 at result (a float)" in message
    assert "no op computing was recorded" in message and "outside torch ops" in message


def test_check_reproducible_refuses_a_locate_that_is_not_a_bool():
    with pytest.raises(TypeError, match="locate must be True or False"):
        detctx.check_reproducible(train_step, locate="yes")


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("relative.trace", "not an absolute path"),
        ("/nonexistent-folder-for-detctx/run1.trace", "does not exist"),
        ("EXISTING", "exists already"),
    ],
)
def test_a_bad_trace_variable_is_reported_and_nothing_is_recorded(
    value: str, complaint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    from detctx._locate.child import TRACE_ENV, start_from_environment

    if value == "EXISTING":
        value = str(tmp_path / "run1.trace")
        Path(value).write_bytes(b"someone else's")
    monkeypatch.setenv(TRACE_ENV, value)

    assert start_from_environment() is False

    assert complaint in capsys.readouterr().err
    assert TRACE_ENV not in os.environ
    assert torch._C._len_torch_dispatch_stack() == 0


class Captured:
    """A sink that keeps every record (and no tensors)."""

    def __init__(self) -> None:
        self.records: list[OpRecord] = []

    def add_batch(self, batch: Batch) -> None:
        self.records.extend(batch.records())


def test_copies_and_views_are_not_recorded_and_a_value_from_outside_counts_where_it_is_used():
    outside = torch.zeros(3, 4, 4)
    weights = torch.randn(4, 4, requires_grad=True)
    sink = Captured()
    recorder = OpRecorder(sink)
    recorder.start()
    try:
        outside.numpy()[0, 0, 0] = fresh_entropy()  # no op writes this
        copied = outside.clone()
        (copied @ weights).sum().backward()  # the first op computing from it
    finally:
        recorder.stop()

    ops = [record.op for record in sink.records]
    assert "aten::clone" not in ops and "aten::_unsafe_view" not in ops
    first = sink.records[0]
    assert first.op in ("aten::bmm", "aten::mm")
    assert first.source.endswith(line_of("computing from it"))


def test_recording_keeps_no_output_alive_once_the_next_op_has_run():
    sink = Captured()
    recorder = OpRecorder(sink)
    recorder.start()
    try:
        weights = torch.randn(256, 256, requires_grad=True)
        activation = torch.tanh(weights @ weights)
        alive = weakref.ref(activation)
        del activation
        torch.relu(weights)  # the next op
        assert alive() is None
    finally:
        recorder.stop()
    assert [record.op for record in sink.records] == [
        "aten::randn",
        "aten::mm",
        "aten::tanh",
        "aten::relu",
    ]
