"""Warnings point at the user's line, and the former names warn, naming the new ones."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

import detctx
from detctx import DeterminismWarning


def line_after() -> int:
    """The number of the line after the caller's."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno + 1


def test_the_cublas_warning_of_a_with_block_points_at_the_with_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    with pytest.warns(DeterminismWarning, match="CUBLAS_WORKSPACE_CONFIG") as caught:
        line = line_after()
        with detctx.deterministic(seed=0):
            pass

    [warning] = [w for w in caught if "CUBLAS" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_the_same_warning_from_seed_all_and_a_decorated_call_points_at_the_callers_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    @detctx.deterministic(seed=1)
    def step() -> None:
        pass

    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    with pytest.warns(DeterminismWarning, match="CUBLAS") as by_seed_all:
        seed_all_line = line_after()
        detctx.seed_all(3)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    with pytest.warns(DeterminismWarning, match="CUBLAS") as by_call:
        call_line = line_after()
        step()

    for caught, line in ((by_seed_all, seed_all_line), (by_call, call_line)):
        [warning] = [w for w in caught if "CUBLAS" in str(w.message)]
        assert (warning.filename, warning.lineno) == (__file__, line)


@pytest.mark.parametrize(
    ("old", "new"),
    [("Run", "Seeding"), ("DistributedRun", "DistributedSeeding"), ("RNGState", "Snapshot")],
)
def test_a_former_name_warns_naming_the_new_one_and_still_works(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"detctx.{old} is deprecated.*use detctx.{new}"):
        value = getattr(detctx, old)

    assert value is getattr(detctx, new)
    assert old not in detctx.__all__


def test_a_former_name_warns_at_the_users_line_on_every_use() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = line_after()
        detctx.Run  # noqa: B018
        detctx.Run  # noqa: B018

    assert [(w.category, w.filename, w.lineno) for w in caught] == [
        (DeprecationWarning, __file__, first),
        (DeprecationWarning, __file__, first + 1),
    ]


def test_under_w_error_a_former_name_raises() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(DeprecationWarning, match=r"use detctx\.Snapshot"):
            detctx.RNGState  # noqa: B018
