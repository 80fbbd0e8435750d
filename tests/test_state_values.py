"""RNG states compare by value: a device's pending seed equals that device woken and not drawn.

The simulated NPU (tests/simulated_npu.py) runs in subprocesses with CUDA hidden,
so the NPU is the only accelerator; the same checks on real CUDA are at the end,
marked ``cuda``.
"""

from __future__ import annotations

import struct

import pytest
import torch
from conftest import HIDE_CUDA, run_python

import detctx
from detctx._sources.accelerators import Uninitialised
from detctx._state.values import accelerator_value


def philox(seed: int, offset: int) -> torch.Tensor:
    """A CUDA-layout RNG state: seed then Philox offset, little-endian uint64 each."""
    return torch.frombuffer(bytearray(struct.pack("<QQ", seed, offset)), dtype=torch.uint8)


def test_a_pending_seed_equals_a_philox_device_seeded_with_it_and_not_drawn_from() -> None:
    pending = Uninitialised(seed_before=5, mark=None)

    assert accelerator_value(pending) == accelerator_value((philox(5, 0), philox(5, 0)))
    assert accelerator_value(pending) != accelerator_value((philox(5, 4),))
    assert accelerator_value(pending) != accelerator_value((philox(6, 0),))
    assert accelerator_value(pending) != accelerator_value((philox(5, 0), philox(5, 4)))


def test_a_cpu_layout_device_state_is_fresh_only_right_after_seeding() -> None:
    seeded = torch.Generator().manual_seed(11)
    fresh = seeded.get_state()
    torch.rand(1, generator=seeded)

    assert accelerator_value((fresh,)) == accelerator_value(Uninitialised(11, None))
    assert accelerator_value((seeded.get_state(),)) != accelerator_value(Uninitialised(11, None))


def test_states_that_are_not_fresh_compare_byte_for_byte() -> None:
    drawn = philox(5, 8)

    assert accelerator_value((drawn,)) == accelerator_value((drawn.clone(),))
    assert accelerator_value((drawn,)) != accelerator_value((philox(5, 12),))


def test_snapshots_compare_by_value() -> None:
    torch.manual_seed(3)
    first = detctx.capture()
    second = detctx.capture()
    torch.rand(1)

    assert first == second
    assert first != detctx.capture()
    assert first != object()


def npu_python(code: str) -> str:
    return run_python("import simulated_npu as sim\nsim.install(2)\n" + code, env=HIDE_CUDA)


@pytest.mark.slow
def test_waking_a_seeded_npu_without_drawing_leaves_every_fingerprint_as_it_was() -> None:
    out = npu_python(
        """
import torch, detctx

torch.manual_seed(5)                         # queued for the NPU, which sleeps
asleep = detctx.capture()
fingerprint, per_source = detctx.fingerprint(), asleep.source_fingerprints()
torch.npu.get_rng_state_all()                # wakes it: both devices at seed 5, nothing drawn
awake = detctx.capture()
assert isinstance(awake["npu"], tuple), awake["npu"]
assert detctx.fingerprint() == fingerprint
assert awake.source_fingerprints() == per_source
assert awake == asleep
sim.rand(1, 1)                                # a draw on device 1 is a real change
assert detctx.fingerprint() != fingerprint and detctx.capture() != asleep
print("ok")
"""
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_a_state_put_back_with_set_rng_state_all_equals_itself() -> None:
    out = npu_python(
        """
import torch, detctx

sim.init()
torch.manual_seed(5)
sim.rand(3, 0)
before = detctx.capture()
states = torch.npu.get_rng_state_all()
sim.rand(3, 0), sim.rand(3, 1)
torch.npu.set_rng_state_all(states)
assert detctx.capture() == before and detctx.fingerprint() == before.fingerprint()
print("ok")
"""
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_a_block_that_wakes_the_npu_leaves_the_fingerprint_as_before() -> None:
    out = npu_python(
        """
import torch, detctx

torch.manual_seed(5)
before = detctx.fingerprint()
with detctx.deterministic(seed=0):
    torch.npu.get_rng_state()                 # a library peeks at the NPU's state
assert torch.npu.is_initialized()
assert detctx.fingerprint() == before
print("ok")
"""
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_check_reproducible_accepts_a_run_that_first_uses_the_npu_later() -> None:
    out = npu_python(
        """
import torch, detctx

calls = []

def evaluate():
    calls.append(1)
    if len(calls) == 2:                       # a cache built on the second call wakes the NPU
        torch.npu.get_rng_state()
    return torch.rand(3)

detctx.check_reproducible(evaluate, runs=2, check_rng=True)
assert torch.npu.is_initialized()
print("ok")
"""
    )
    assert out.strip() == "ok"


@pytest.mark.slow
def test_ranks_whose_npu_sleeps_or_is_awake_give_the_same_verification_row() -> None:
    out = npu_python(
        """
import torch, detctx
from detctx._state.snapshot import active_sources
from detctx.distributed._rank_check import verification_row

torch.manual_seed(5)
asleep = verification_row(None, active_sources())
torch.npu.get_rng_state()
assert verification_row(None, active_sources()) == asleep
sim.rand(1, 0)                                # current device 0 drew: the row changes
assert verification_row(None, active_sources()) != asleep
print("ok")
"""
    )
    assert out.strip() == "ok"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_woken_device_and_a_state_put_back_compare_equal() -> None:
    out = run_python(
        """
import torch, detctx

torch.manual_seed(5)
before = detctx.fingerprint()
with detctx.deterministic(seed=0):
    torch.cuda.get_rng_state_all()            # as Lightning's isolate_rng does
assert torch.cuda.is_initialized()
assert detctx.fingerprint() == before
states = torch.cuda.get_rng_state_all()
torch.rand(4, device="cuda")
torch.cuda.set_rng_state_all(states)
assert detctx.fingerprint() == before
torch.rand(4, device="cuda")
assert detctx.fingerprint() != before
print("ok")
"""
    )
    assert out.strip() == "ok"
