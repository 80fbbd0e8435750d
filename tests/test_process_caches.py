"""Process-wide caches have one reset seam, so no test leaves another a stale backend."""

from __future__ import annotations

import pytest
import torch

import detctx
from detctx._basics import reset_caches
from detctx._sources import active_accelerators
from detctx._state import active_sources


def test_device_sources_built_on_a_patched_backend_are_forgotten_on_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_available", lambda: True)
        reset_caches()
        assert "cuda" in [source.device_type for source in active_accelerators()]
        assert "cuda" in dict(active_sources())

    reset_caches()

    assert "cuda" not in [source.device_type for source in active_accelerators()]
    assert "cuda" not in dict(active_sources())
    with detctx.deterministic(seed=0) as seeding:
        assert "cuda" not in seeding.sources

