"""Recording in batches: staged and at-once digests agree, and a divergence keeps its tensors.

Small CPU outputs are staged and digested a batch at a time; large ones
(more than ``STAGED`` bytes) are digested as their op runs. Whichever way an
op goes, its row must be the same, and a divergence found in either must
still come with the count of differing elements.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import detctx
import detctx._locate.outputs as outputs_module
import detctx._locate.recorder as recorder_module
from detctx._locate.batch import Batch
from detctx._locate.digest import STAGED
from detctx._locate.recorder import OpRecorder
from detctx._locate.staging import Staging


class Rows:
    """A sink that keeps every row."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []

    def add_batch(self, batch: Batch) -> None:
        self.rows.append(batch.rows.copy())

    def all(self) -> np.ndarray:
        return np.concatenate(self.rows)


def step(width: int) -> None:
    """A training step whose outputs are small (width 8) or mostly large (width 512)."""
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.3), nn.Linear(width, 4))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        loss = model(torch.randn(64, width)).pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()


def recorded(fn: Callable[[], None], staging: Staging | None = None) -> np.ndarray:
    sink = Rows()
    with detctx.deterministic(seed=11):
        recorder = OpRecorder(sink)
        if staging is not None:
            recorder._staging = staging
        recorder.start()
        try:
            fn()
        finally:
            recorder.stop()
    return sink.all()


@pytest.mark.parametrize("width", [8, 512])
def test_an_ops_row_is_the_same_whether_its_outputs_are_staged_or_digested_at_once(
    width: int, monkeypatch: pytest.MonkeyPatch
):
    staged = recorded(lambda: step(width))
    # A buffer that holds one op's outputs at most: a batch after nearly every op.
    cramped = recorded(lambda: step(width), Staging(capacity=STAGED))
    with monkeypatch.context() as patch:
        patch.setattr(recorder_module, "_stageable", lambda tensor: False)
        at_once = recorded(lambda: step(width))
    assert len(staged) > 50
    for name in ("op", "meta", "random", "rng", "high", "low"):
        assert np.array_equal(staged[name], cramped[name]), name
        assert np.array_equal(staged[name], at_once[name]), name


def test_a_staged_op_that_differs_is_counted_from_the_bytes_it_staged():
    def noisy() -> None:
        weights = torch.randn(16, 16)
        weights.numpy()[3, 4] += (int.from_bytes(os.urandom(4), "little") + 1) * 1e-3
        (weights @ weights).relu()  # reads the changed weight

    found = detctx.locate_divergence(noisy, seed=3)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::mm"
    assert found.total == 256 and found.mismatched == 16 + 16 - 1  # row 3 and column 4


def test_a_large_op_that_differs_is_counted_from_a_copy_kept_as_it_ran():
    def noisy() -> None:
        big = torch.randn(512, 512)  # 1 MiB: digested as its op runs
        big.numpy()[7, 9] += (int.from_bytes(os.urandom(4), "little") + 1) * 1e-3
        doubled = big * 2.0  # reads the changed element
        doubled.add_(1.0)  # writes it again: the copy was taken before

    found = detctx.locate_divergence(noisy, seed=3)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::mul.Tensor"
    assert (found.mismatched, found.total) == (1, 512 * 512)


def test_a_constant_fill_is_not_recorded_and_a_different_fill_shows_where_it_is_read():
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        filled = torch.full((4, 4), float(len(calls)))  # a different number each run
        zeros = torch.zeros(4)
        (filled.sum(dim=0) + zeros).exp()  # the first op that reads it

    rows = recorded(step)
    found = detctx.locate_divergence(step, seed=3)

    names = [record.op for record in Batch(0, rows, lambda _: None).records()]
    assert names == ["aten::sum.dim_IntList", "aten::add.Tensor", "aten::exp"]
    assert found is not None and found.op == "aten::sum.dim_IntList"
    assert found.mismatched == 4


def test_a_large_permuted_output_is_read_in_memory_order_and_still_compared_exactly(
    monkeypatch: pytest.MonkeyPatch,
):
    read: list[bool] = []
    real = outputs_module.memory_order_digest

    def counted(tensor: torch.Tensor) -> int | None:
        found = real(tensor)
        read.append(found is not None)
        return found

    monkeypatch.setattr(outputs_module, "memory_order_digest", counted)
    calls: list[int] = []

    def step(change: bool) -> None:
        calls.append(1)
        base = torch.randn(256, 1024)
        (base.t() * 0.5).sum()  # keeps the transposed strides: 1 MiB, not contiguous
        if change and len(calls) % 2 == 0:
            base.numpy()[1, 2] += 1.0
        (base.t() * 0.5).sum()  # the same op again: differs in the second run only

    assert detctx.locate_divergence(step, False, seed=3) is None
    assert any(read)
    found = detctx.locate_divergence(step, True, seed=3)

    assert found is not None and found.reason == "values"
    assert found.op == "aten::mul.Tensor" and found.index > 2
    assert (found.mismatched, found.total) == (1, 256 * 1024)


def test_agreeing_runs_of_a_step_with_large_and_small_outputs_report_none():
    assert detctx.locate_divergence(step, 512, seed=5) is None
    assert detctx.locate_divergence(step, 8, seed=5) is None


def test_a_divergence_in_one_output_of_many_names_that_output_and_its_shape():
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        tensors = [torch.randn(8) for _ in range(5)] + [torch.randn(3, 300)]
        if len(calls) % 2 == 0:
            tensors[-1].numpy()[2, 7] += 1.0
        torch._foreach_mul_(tensors, 2.0)  # six outputs; the last one differs

    found = detctx.locate_divergence(step, seed=3)

    assert found is not None and found.op == "aten::_foreach_mul_.Scalar"
    assert (found.output, found.outputs, found.shape) == (5, 6, (3, 300))
    assert (found.mismatched, found.total) == (1, 900)
    assert "float32 output 6 of 6, of shape (3, 300), on cpu differs: 1 of 900" in str(found)


def test_after_a_run_parts_no_more_large_outputs_are_copied(monkeypatch: pytest.MonkeyPatch):
    copied: list[int] = []
    real_clone = torch.Tensor.clone

    def counting_clone(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.nbytes > STAGED:
            copied.append(self.nbytes)
        return real_clone(self, *args, **kwargs)  # type: ignore[arg-type]

    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        small = torch.randn(4)
        if len(calls) % 2 == 0:
            small.numpy()[0] += 1.0
        (small * 2).sum()  # the first op that differs: staged
        big = torch.randn(512, 512) + small.sum()  # every later large op differs too
        for _ in range(20):
            big = big * 1.5

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    found = detctx.locate_divergence(step, seed=3)

    assert found is not None and found.op == "aten::mul.Tensor" and found.shape == (4,)
    # One copy at most (the first large op that differed, before the comparison saw the
    # staged one): not one for each of the twenty that follow.
    assert len(copied) <= 1


@pytest.mark.slow
def test_loader_workers_forked_with_outputs_staged_start_without_digesting_them() -> None:
    # OpenMP's threads do not survive a fork: a worker whose first op is a parallel one (a
    # digest of the staged outputs, before the worker's own set_num_threads(1)) waits for
    # them forever. Before: every epoch like this one hung (the loader's timeout says so).
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(32, 256))

    def epoch() -> None:
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        model(torch.randn(256, 256)).sum().backward()  # staged outputs at the fork
        loader = DataLoader(
            data, batch_size=8, num_workers=2, generator=detctx.loader_generator(), timeout=60
        )
        for (batch,) in loader:
            model(batch).sum().backward()

    assert detctx.locate_divergence(epoch) is None
