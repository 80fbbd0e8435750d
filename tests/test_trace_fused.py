"""A module run as one fused kernel in one environment and as its parts in the other (an LSTM
with oneDNN and without) is the same program: compared at its boundary, not refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import detctx
from detctx._compare.reading import read_trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.lstm = torch.nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))  # the final states are dropped
        return self.head(hidden)


def run(path: Path, onednn: bool, scale: float = 1.0) -> Path:
    torch.manual_seed(0)
    model = Tagger()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.no_grad():
        model.lstm.weight_hh_l1.mul_(scale)  # B's change, inside the LSTM
    tokens = torch.randint(0, 50, (4, 12))
    labels = torch.randint(0, 5, (4, 12))
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = onednn
    try:
        record(path, model, optimiser, tokens, labels)
    finally:
        torch.backends.mkldnn.enabled = before
    return path


def record(
    path: Path,
    model: Tagger,
    optimiser: torch.optim.Optimizer,
    tokens: torch.Tensor,
    labels: torch.Tensor,
) -> None:
    with detctx.recording(path):
        for _ in range(2):
            optimiser.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
            optimiser.step()


@pytest.fixture
def fused(tmp_path: Path) -> Path:
    path = run(tmp_path / "fused.trace", onednn=True)
    trace = read_trace(path)
    if "aten::mkldnn_rnn_layer" not in {trace.text(op) for op in trace.ops["op"]}:
        pytest.skip("this torch runs the LSTM op by op with oneDNN on too")
    return path


def test_an_lstm_with_onednn_against_one_without_compares_within_tolerance(
    fused: Path, tmp_path: Path
) -> None:
    unfused = run(tmp_path / "unfused.trace", onednn=False)
    assert len(read_trace(unfused)) > 4 * len(read_trace(fused))
    result = detctx.compare_traces(fused, unfused)
    assert result.agree and not result.bitwise and result.unpaired == []
    assert any(entry["module_path"] == "Tagger.lstm" for entry in result.partial_alignment)


def test_a_change_inside_the_fused_module_is_named_at_the_module(
    fused: Path, tmp_path: Path
) -> None:
    changed = run(tmp_path / "changed.trace", onednn=False, scale=1.01)
    origin = detctx.compare_traces(fused, changed).origin
    assert origin is not None and origin.module_path == "Tagger.lstm"
    assert origin.input_error == 0


class Padded(torch.nn.Module):
    """A layer that, with ``extra``, also computes ten things nobody reads."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)  # in this module's own segment
        if self.extra:
            for k in range(10):
                _ = (y * (k + 2)).sum()  # dead: its value reaches nothing
        return y


def test_ops_one_side_adds_whose_values_nothing_reads_still_differ(tmp_path: Path) -> None:
    # B's module runs more than FUSED times A's ops, as a fused kernel's parts would; but
    # only B leaves values nobody reads there: a different program, not noise.
    def run_padded(path: Path, extra: bool) -> Path:
        torch.manual_seed(0)
        net = torch.nn.Sequential(Padded(extra), torch.nn.ReLU())
        with detctx.recording(path):
            net(torch.randn(4, 8)).sum().backward()
        return path

    a = run_padded(tmp_path / "a.trace", extra=False)
    b = run_padded(tmp_path / "b.trace", extra=True)
    result = detctx.compare_traces(a, b)
    assert not result.agree
    assert [entry.trace for entry in result.unpaired] == ["B"] * len(result.unpaired)
    assert sum(entry.ops for entry in result.unpaired) >= 10
