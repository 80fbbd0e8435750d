"""Recording leaves a distributed program as it is: storage FSDP2 frees stays resizable,
DTensor outputs are recorded as each rank's shard, and a collective is recorded once it has
completed, so two recordings of one run agree bit for bit and the losses are those of an
unrecorded run; a collective whose inputs agree and whose result differs is named."""

from __future__ import annotations

from pathlib import Path

import torch

import detctx


def frees_its_outputs() -> None:
    """What FSDP2 does with an unsharded parameter: computes into it, then frees its memory."""
    small = torch.ones(8) * 2  # small outputs are copied into NumPy
    half = torch.ones(64, dtype=torch.bfloat16) * 3  # a dtype NumPy cannot read
    flags = torch.ones(8) > 1
    large = torch.ones(40_000) * 4  # copied for the helper, or summarised in line
    for tensor in (small, half, flags, large):
        tensor.untyped_storage().resize_(0)


def test_storage_a_recording_has_read_can_still_be_freed(tmp_path: Path) -> None:
    with detctx.recording(tmp_path / "a.trace"):
        frees_its_outputs()
    assert detctx.compare_traces(tmp_path / "a.trace", tmp_path / "a.trace").bitwise


def test_storage_locate_has_read_can_still_be_freed() -> None:
    assert detctx.locate_divergence(frees_its_outputs, runs=2) is None
