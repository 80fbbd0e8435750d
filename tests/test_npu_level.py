"""The ``npu_level`` switch: torch_npu's determinism levels, on the simulated NPU.

The simulated NPU (tests/simulated_npu.py) keeps one level per process and keeps
it in step with ``torch.use_deterministic_algorithms``, warning as torch_npu does;
``install(levels=False)`` is an older torch_npu without the API.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import HIDE_CUDA, run_python

import detctx


def test_a_bad_npu_level_fails_at_configuration_in_every_entry_point() -> None:
    for make in (detctx.deterministic, detctx.seed_all, detctx.distributed_deterministic):
        for bad, error in ((0, ValueError), (4, ValueError), (True, TypeError), ("2", TypeError)):
            with pytest.raises(error, match="npu_level must be None, 1, 2 or 3"):
                make(seed=1, npu_level=bad)  # type: ignore[arg-type]
    assert not torch.are_deterministic_algorithms_enabled()


def test_without_an_npu_the_level_is_a_no_op_that_the_log_line_reports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="detctx"):
        with detctx.deterministic(seed=1, npu_level=2) as seeding:
            assert torch.are_deterministic_algorithms_enabled()
    assert "npu_level=2 (no NPU: not applied)" in seeding.switches
    assert "npu_level=2 (no NPU: not applied)" in caplog.text
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_default_level_follows_algorithms_and_is_not_logged() -> None:
    block = detctx.deterministic(seed=1)
    with block as seeding:
        pass
    assert not any(part.startswith("npu_level") for part in seeding.switches)
    assert repr(block) == "deterministic(seed=1)"
    assert repr(detctx.deterministic(seed=1, npu_level=3)) == "deterministic(seed=1, npu_level=3)"


@pytest.mark.slow
def test_levels_are_set_inside_blocks_and_put_back_with_torchs_flag() -> None:
    out = run_python(
        """
        import warnings
        import simulated_npu as sim
        sim.install(2, levels=True)
        import torch, detctx
        from detctx import DeterminismWarning

        def state():
            return (sim._get_deterministic_level(), torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled())

        warnings.simplefilter("error")             # no torch_npu warning may reach the user
        assert state() == (0, False, False)
        with detctx.deterministic(seed=0):         # None: torch_npu's level API is not used
            assert state() == (1, True, False)
        assert state() == (0, False, False) and sim.level_calls == 0
        with detctx.deterministic(seed=0, npu_level=2) as seeding:
            assert state() == (2, True, False), state()
            assert "npu_level=2" in seeding.switches
            with detctx.deterministic(seed=1, npu_level=3):
                assert state() == (3, True, False)
            assert state() == (2, True, False)
            with detctx.deterministic(seed=1):   # None: the level is left as it is
                assert state() == (2, True, False)
        assert state() == (0, False, False), state()

        # torch_npu turns torch's flag on with the level; the algorithms switch puts it back.
        with detctx.deterministic(seed=0, algorithms=False, npu_level=1):
            assert state() == (1, True, False)
        assert state() == (0, False, False)
        with detctx.deterministic(seed=0, algorithms="warn", npu_level=2):
            assert state() == (2, True, True)
        assert state() == (0, False, False)

        # A user's own level and flag come back exactly.
        torch.use_deterministic_algorithms(True, warn_only=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sim.set_deterministic_level(2)
            torch.use_deterministic_algorithms(True, warn_only=True)
        with detctx.deterministic(seed=0, npu_level=3):
            assert state() == (3, True, False)
        assert state() == (2, True, True), state()
        with detctx.deterministic(seed=0, npu_level=2):
            pass
        assert state() == (2, True, True)

        # seed_all sets it for good, like the other switches; detctx doctor shows it.
        detctx.seed_all(3, npu_level=1)
        assert state() == (1, True, False)
        from detctx._proving.doctor import diagnose
        assert diagnose().flags["torch_npu.npu._get_deterministic_level"] == 1
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_a_level_the_runtime_refuses_raises_and_leaves_everything_as_it_was() -> None:
    out = run_python(
        """
        import os, warnings
        import simulated_npu as sim
        sim.install(1, levels=True, max_level=2)
        import torch, detctx

        warnings.simplefilter("error")
        before = (sim._get_deterministic_level(), torch.are_deterministic_algorithms_enabled(),
                  os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.initial_seed())
        try:
            with detctx.deterministic(seed=5, npu_level=3):
                raise AssertionError("entered")
        except detctx.DeterminismUnavailableError as exc:
            assert "npu_level=2" in str(exc), exc
        after = (sim._get_deterministic_level(), torch.are_deterministic_algorithms_enabled(),
                 os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.initial_seed())
        assert before == after, (before, after)
        assert detctx.open_blocks() == ()
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_an_npu_whose_torch_npu_lacks_levels_warns_naming_the_version_needed() -> None:
    out = run_python(
        """
        import warnings
        import simulated_npu as sim
        sim.install(1)                                  # an older torch_npu
        import torch, detctx

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with detctx.deterministic(seed=0, npu_level=1) as seeding:
                assert torch.are_deterministic_algorithms_enabled()
        assert caught == [], [str(w.message) for w in caught]
        assert "npu_level=1 (algorithms on: this torch_npu has no levels)" in seeding.switches

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with detctx.deterministic(seed=0, algorithms=False, npu_level=3) as seeding:
                assert torch.are_deterministic_algorithms_enabled()
        assert not torch.are_deterministic_algorithms_enabled()
        [warning] = caught
        assert warning.category is detctx.DeterminismWarning
        assert "2.6.0.post6" in str(warning.message) and "npu_level=3" in str(warning.message)
        from detctx._proving.doctor import diagnose
        shown = diagnose().flags["torch_npu.npu._get_deterministic_level"]
        assert shown.startswith("not in this torch_npu (needs torch_npu 2.6.0.post6"), shown
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_any_nesting_of_levels_and_algorithm_settings_restores_the_users_state() -> None:
    out = run_python(
        """
        import warnings
        import simulated_npu as sim
        sim.install(1, levels=True)
        import torch, detctx
        from hypothesis import given, settings, strategies as st

        warnings.simplefilter("error")
        levels = st.sampled_from([None, 1, 2, 3])
        algorithms = st.sampled_from([True, False, "warn"])

        def state():
            return (sim._get_deterministic_level(), torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled())

        @settings(max_examples=60, deadline=None, database=None)
        @given(st.sampled_from([0, 1, 2, 3]), st.booleans(),
               st.lists(st.tuples(algorithms, levels), min_size=1, max_size=4))
        def check(user_level, warn_only, blocks):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sim.set_deterministic_level(user_level)
                if user_level:
                    torch.use_deterministic_algorithms(True, warn_only=warn_only)
            outer = state()

            def nest(rest):
                if not rest:
                    return
                algo, level = rest[0]
                before = state()
                with detctx.deterministic(seed=0, algorithms=algo, npu_level=level):
                    if level is not None:
                        assert state()[0] == level
                    if algo == "warn" or level is not None or algo is True:
                        assert state()[1]
                    nest(rest[1:])
                assert state() == before, (before, state(), rest)

            nest(blocks)
            assert state() == outer

        check()
        print("ok")
        """,
        env=HIDE_CUDA,
    )
    assert out.strip() == "ok"


@pytest.mark.deterministic(seed=0, npu_level=2)
def test_the_pytest_marker_takes_the_level(detctx_seeding: detctx.Seeding) -> None:
    assert "npu_level=2 (no NPU: not applied)" in detctx_seeding.switches


def test_distributed_deterministic_takes_the_level_in_a_process_group(tmp_path: Path) -> None:
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    try:
        with detctx.distributed_deterministic(seed=3, npu_level=3) as seeding:
            assert torch.are_deterministic_algorithms_enabled()
    finally:
        dist.destroy_process_group()
    assert "npu_level=3 (no NPU: not applied)" in seeding.switches
    assert not torch.are_deterministic_algorithms_enabled()
