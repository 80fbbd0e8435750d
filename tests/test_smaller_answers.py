"""The smaller answers of round five: a result divergence knows its tensor's dtype and
shape, a trace plot labels its lines and marks the passes, and more."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

import detctx


def test_a_result_divergence_carries_the_dtype_and_shape_its_text_gives():
    found = detctx.locate_divergence(
        lambda: torch.from_numpy(np.random.default_rng().random((4, 2))).clone()
    )

    assert found is not None and found.reason == "result"
    assert (found.dtype, found.shape, found.device) == ("float64", (4, 2), "cpu")
    assert f"{found.dtype} tensor of shape {found.shape}" in str(found)


def test_a_result_divergence_in_a_plain_value_leaves_dtype_and_shape_empty():
    found = detctx.locate_divergence(lambda: float(np.random.default_rng().random()))

    assert found is not None and found.reason == "result"
    assert (found.dtype, found.shape, found.device) == ("", (), "")


def record_steps(folder, name: str, scale: float) -> None:
    """Three steps of a small model with AdamW, the hidden layer scaled by ``scale`` in step 2."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 8)
    with detctx.recording(folder / name):
        for step in range(3):
            hidden = model[0](x) * (scale if step == 1 else 1.0)
            loss = model[2](model[1](hidden)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def test_a_trace_plot_labels_every_line_and_shades_backward_and_update(tmp_path):
    pytest.importorskip("matplotlib")
    from detctx._cli.trace_compare import SAME_BITS, error_figure, phases, plot_errors

    for name, scale in (("a.trace", 1.0), ("b.trace", 1.001), ("c.trace", 1.5)):
        record_steps(tmp_path, name, scale)
    mild = detctx.compare_traces(tmp_path / "a.trace", tmp_path / "b.trace")
    strong = detctx.compare_traces(tmp_path / "a.trace", tmp_path / "c.trace")

    figures = [error_figure(mild), error_figure(strong)]
    try:
        labels = [text.get_text() for text in figures[0].axes[0].get_legend().get_texts()]
        floors = [figure.axes[0].get_ylim() for figure in figures]
        ticks = figures[0].axes[0].get_yticklabels()
    finally:
        import matplotlib.pyplot as pyplot

        for figure in figures:
            pyplot.close(figure)
    plot_errors(mild, tmp_path / "errors.png")

    assert (tmp_path / "errors.png").stat().st_size > 0
    assert "tolerance, rank 0 (ops with float outputs)" in labels  # the dashed line
    assert any(label.startswith("backward pass") for label in labels)
    assert any(label.startswith("after backward, outside modules (optimizer") for label in labels)
    assert floors[0] == floors[1] and floors[0][0] < SAME_BITS  # same bits: one row in every plot
    assert ticks[0].get_text() == "same bits"
    ops = mild.ranks[0].b
    shaded = phases(ops.ops, ops.strings)
    # The program's ops (not detctx's rows of parameters and constants where first read).
    program = np.array([not ops.text(op).startswith("detctx::") for op in ops.ops["op"]])
    backward, update = shaded["backward"][program], shaded["update"][program]
    # step 1: 5 forward ops, 7 backward, AdamW's 9 for each of the 4 parameters
    assert backward[:48].sum() == 7 and update[:48].sum() == 36
    assert not (backward | update)[:5].any()


@pytest.mark.parametrize("scenario", ["three tasks", "nested blocks in two tasks"])
def test_after_out_of_order_exits_in_overlapping_tasks_the_callers_rng_is_where_it_was(
    scenario: str,
) -> None:
    # Before: the caller's RNG had moved in 78 of 400 rounds with three tasks and in 243 of
    # 400 with nested blocks (benchmarks/hammer_async_exits.py): a block closed early put
    # back the state inside an enclosing block that had exited since.
    timing = random.Random(5)

    async def task(seed: int, delays: list[float]) -> None:
        try:
            with detctx.deterministic(seed=seed):
                if scenario.startswith("nested"):
                    with detctx.deterministic(seed=seed + 100):
                        await draws(delays)
                else:
                    await draws(delays)
        except detctx.OutOfOrderExitError:
            pass

    async def draws(delays: list[float]) -> None:
        for delay in delays:
            await asyncio.sleep(delay)
            random.random()
            torch.rand(1)

    async def overlapping(delays: list[list[float]]) -> None:
        await asyncio.gather(*(task(seed, d) for seed, d in enumerate(delays)))

    tasks = 3 if scenario == "three tasks" else 2
    moved = 0
    for _ in range(40):
        random.seed(7)
        torch.manual_seed(7)
        before = detctx.fingerprint()
        delays = [[timing.uniform(0, 0.003) for _ in range(3)] for _ in range(tasks)]
        asyncio.run(overlapping(delays))
        moved += detctx.fingerprint() != before

    assert moved == 0
    assert detctx.open_blocks() == ()
