"""The smaller answers of round five: a result divergence knows its tensor's dtype and
shape, a trace plot labels its lines and marks the passes, and more."""

from __future__ import annotations

import numpy as np
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
