"""The NPU code path, on the simulated NPU (tests/simulated_npu.py) in subprocesses.

The simulated device registers itself the way torch_npu does, so detctx finds it
through the same device-module lookup it uses for CUDA.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HIDE_CUDA, run_python


@pytest.mark.slow
def test_two_simulated_npus_are_seeded_captured_and_restored() -> None:
    out = run_python(
        """
        import simulated_npu as sim
        sim.install(2)
        import torch, detctx

        sim.init()                                   # the program already uses its NPUs
        torch.manual_seed(5)
        outside = [sim.rand(3, d) for d in (0, 1)]
        with detctx.deterministic(seed=0) as run:
            assert "npu" in run.sources, run.sources
            inside = [sim.rand(3, d) for d in (0, 1)]
        after = [sim.rand(3, d) for d in (0, 1)]

        torch.manual_seed(5)
        ref_outside = [sim.rand(3, d) for d in (0, 1)]
        ref_after = [sim.rand(3, d) for d in (0, 1)]
        torch.manual_seed(0)
        ref_inside = [sim.rand(3, d) for d in (0, 1)]
        eq = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
        assert eq(outside, ref_outside) and eq(after, ref_after) and eq(inside, ref_inside)
        assert not torch.equal(inside[0], outside[0])

        state = detctx.capture()
        assert len(state["npu"]) == 2                # one state per device
        first = sim.rand(4, 1)
        state.restore()
        assert torch.equal(sim.rand(4, 1), first)
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_capture_never_initialises_an_unused_npu() -> None:
    out = run_python(
        """
        import simulated_npu as sim
        sim.install(2)
        import torch, detctx

        detctx.capture()
        detctx.fingerprint()
        with detctx.deterministic(seed=0):
            torch.rand(3)
        assert sim.init_count == 0 and not sim.is_initialized()
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_an_npu_first_used_inside_the_block_is_seeded_then_reset_to_the_outer_seed() -> None:
    out = run_python(
        """
        import simulated_npu as sim
        sim.install(2)
        import torch, detctx

        torch.manual_seed(5)                          # queued lazily for the NPU
        with detctx.deterministic(seed=0):
            inside = sim.rand(3, 1)                   # first use: initialises the NPU
        after = sim.rand(3, 1)
        assert sim.init_count == 1

        # Reference: a process that never ran the block, and one that seeds 0.
        ref = [torch.Generator().manual_seed(s) for s in (0, 5)]
        assert torch.equal(inside, torch.rand(3, generator=ref[0]))
        assert torch.equal(after, torch.rand(3, generator=ref[1]))
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_blocks_on_an_unused_npu_leave_its_lazy_queue_as_it_was() -> None:
    out = run_python(
        """
        import simulated_npu as sim
        sim.install(2)
        import torch, detctx

        torch.manual_seed(5)
        queued = list(sim._queued_calls)
        for i in range(200):
            with detctx.deterministic(seed=i % 3):
                with detctx.deterministic(seed=7):
                    pass
        assert sim._queued_calls == queued, len(sim._queued_calls)

        # A repeated seed costs no lazy call at all once it is queued.
        detctx.seed_all(9)
        calls = len(sim._queued_calls)
        traces = []
        import traceback
        real = traceback.format_stack
        traceback.format_stack = lambda *a, **k: traces.append(1) or real(*a, **k)
        for _ in range(50):
            with detctx.deterministic(seed=9):
                pass
        traceback.format_stack = real
        assert len(sim._queued_calls) == calls and traces == [], (len(sim._queued_calls), traces)

        # ... and after all that the device still starts from the last seed the program set.
        first = sim.rand(3, 0)
        assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(9)))
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed_tracker",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not hasattr(torch._utils, "_LazySeedTracker"),
                reason="this torch's CUDA queues seeds without a tracker",
            ),
        ),
    ],
    ids=["torch_npu-queue", "cuda-tracker"],
)
def test_repeated_blocks_on_an_unused_npu_make_one_lazy_call_in_all(seed_tracker: bool) -> None:
    out = run_python(
        f"""
        import traceback
        import simulated_npu as sim
        sim.install(2, seed_tracker={seed_tracker})
        import torch, detctx

        torch.manual_seed(5)
        traces = []
        real = traceback.format_stack
        traceback.format_stack = lambda *a, **k: traces.append(1) or real(*a, **k)
        for _ in range(100):
            with detctx.deterministic(seed=0):      # the eval pass: a seed unlike the outer one
                pass
        assert len(traces) == 1, len(traces)
        # Only torch.manual_seed(5)'s entry is queued (in the tracker, if there is one).
        assert len(sim._queued_calls) == (0 if {seed_tracker} else 1)
        with detctx.deterministic(seed=0):
            inside = sim.rand(3, 1)                  # first use, inside a block: seeded with 0
        traceback.format_stack = real
        seeded = lambda s: torch.Generator().manual_seed(s)
        assert torch.equal(inside, torch.rand(3, generator=seeded(0)))
        assert torch.equal(sim.rand(3, 0), torch.rand(3, generator=seeded(5)))
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_the_npu_determinism_warning_names_the_once_per_thread_rule() -> None:
    out = run_python(
        """
        import warnings
        import simulated_npu as sim
        sim.install(1)
        import torch, detctx

        sim.init()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with detctx.deterministic(seed=0):
                pass
        messages = [str(w.message) for w in caught if w.category is detctx.DeterminismWarning]
        assert any("once per thread" in m for m in messages), messages
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_no_npu_module_and_an_unavailable_npu_are_handled() -> None:
    out = run_python(
        """
        import torch, detctx
        assert not hasattr(torch, "npu")
        with detctx.deterministic(seed=0) as run:
            pass
        assert run.sources == ("python", "numpy", "torch"), run.sources

        import simulated_npu as sim
        sim.install(0)                                 # torch.npu exists, no device
        with detctx.deterministic(seed=0) as run:
            pass
        assert "npu" not in run.sources
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_a_broken_torch_npu_install_is_a_warning_not_a_crash(tmp_path) -> None:
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file')\n"
    )
    out = run_python(
        """
        import warnings
        import torch, detctx
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with detctx.deterministic(seed=0) as run:
                pass
        messages = [str(w.message) for w in caught]
        assert any("TORCH_DEVICE_BACKEND_AUTOLOAD=0" in m for m in messages), messages
        assert "npu" not in run.sources
        print("ok")
        """,
        path=(str(tmp_path),),
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"
