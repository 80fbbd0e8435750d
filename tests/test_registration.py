"""Registering a source or an accelerator fails at the call, with nothing registered."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import CounterSource, run_python

import detctx


class _NotCallable:
    capture = 1
    restore = "restore"
    seed = 2.5


class _BadValidator(CounterSource):
    validate_state = 3


def test_a_source_whose_methods_are_not_callable_is_refused_at_registration() -> None:
    with pytest.raises(TypeError, match=r"capture, restore, seed must be method"):
        detctx.register_source("broken", _NotCallable())
    with detctx.deterministic(seed=1):  # nothing was registered: blocks still work
        pass
    detctx.register_source("broken", CounterSource())
    detctx.unregister_source("broken")


def test_a_source_with_a_validate_state_that_is_not_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="validate_state"):
        detctx.register_source("broken", _BadValidator())


@pytest.mark.parametrize("name", ["nonexistent", "CPU", "cuda:0", "meta", "python", "hpu", " cuda"])
def test_register_accelerator_refuses_a_name_torch_has_no_device_module_for(name: str) -> None:
    with pytest.raises(ValueError, match=r"device module|device type"):
        detctx.register_accelerator(name)
    if name != "python":  # the name was not taken: a user source may still use it
        detctx.register_source(name, CounterSource())
        detctx.unregister_source(name)


def test_register_accelerator_names_the_rng_functions_a_device_module_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    half_backend = types.ModuleType("half_backend")
    half_backend.is_available = lambda: True  # type: ignore[attr-defined]
    half_backend.get_rng_state = lambda device=0: torch.zeros(8, dtype=torch.uint8)  # type: ignore[attr-defined]
    monkeypatch.setattr(torch, "hpu", half_backend, raising=False)
    with pytest.raises(ValueError, match=r"set_rng_state, manual_seed_all \(or manual_seed\)"):
        detctx.register_accelerator("hpu")


def test_register_accelerator_accepts_a_device_type_with_the_rng_functions() -> None:
    # In a child: a registration lasts for the process, and this backend is a stand-in.
    out = run_python(
        """
        import types, torch, detctx

        hpu = types.ModuleType("hpu")  # a backend whose one device draws from a CPU generator
        generator = torch.Generator().manual_seed(11)
        hpu.is_available = lambda: True
        hpu.device_count = lambda: 1
        hpu.get_rng_state = lambda device=0: generator.get_state()
        hpu.set_rng_state = lambda state, device=0: generator.set_state(state)
        hpu.manual_seed_all = lambda seed: generator.manual_seed(seed)
        torch.hpu = hpu

        detctx.register_accelerator("hpu")

        torch.rand(1, generator=generator)
        before = generator.get_state()
        with detctx.deterministic(seed=1) as seeding:
            assert "hpu" in seeding.sources, seeding.sources
            inside = torch.rand(3, generator=generator)
        assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(1)))
        assert torch.equal(generator.get_state(), before)
        assert "hpu" in detctx.capture().source_fingerprints()
        print("managed")
        """
    )
    assert out.split() == ["managed"]
