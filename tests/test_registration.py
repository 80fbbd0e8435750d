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


def test_a_source_class_instead_of_an_instance_is_refused_naming_the_fix() -> None:
    with pytest.raises(TypeError, match=r"the class 'CounterSource'.*CounterSource\(\)"):
        detctx.register_source("counter", CounterSource)
    with detctx.deterministic(seed=1):  # before, every block raised TypeError from here on
        pass


class _RestoreWithoutState(CounterSource):
    def restore(self) -> None:  # type: ignore[override]
        self.value = 0


class _CaptureWithAnArgument(CounterSource):
    def capture(self, device: str) -> int:  # type: ignore[override]
        return self.value


class _SeedWithTwo(CounterSource):
    def seed(self, seed: int, offset: int) -> None:  # type: ignore[override]
        self.value = seed + offset


class _PlainWithout(CounterSource):
    def state_to_plain(self) -> int:
        return self.value

    def state_from_plain(self, plain: int) -> int:
        return plain


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (_RestoreWithoutState(), r"calls restore\(state\), but restore takes \(\)"),
        (_CaptureWithAnArgument(), r"calls capture\(\), but capture takes \(device\)"),
        (_SeedWithTwo(), r"calls seed\(seed\), but seed takes \(seed, offset\)"),
        (_PlainWithout(), r"calls state_to_plain\(state\), but state_to_plain takes \(\)"),
    ],
    ids=["restore()", "capture(device)", "seed(seed, offset)", "state_to_plain()"],
)
def test_a_source_whose_methods_take_the_wrong_arguments_is_refused(
    source: object, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        detctx.register_source("broken", source)
    with detctx.deterministic(seed=1):
        pass
    detctx.register_source("broken", CounterSource())  # the name was not taken
    detctx.unregister_source("broken")


class _Flexible(CounterSource):
    def capture(self, *args: object) -> int:  # type: ignore[override]
        return self.value

    def seed(self, seed: int, offset: int = 0, **options: object) -> None:
        self.value = seed + offset


class _BuiltinMethods:
    """Methods of a C type, whose signatures Python cannot read."""

    def __init__(self) -> None:
        generator = torch.Generator()
        self.capture, self.restore, self.seed = (
            generator.get_state,
            generator.set_state,
            generator.manual_seed,
        )


@pytest.mark.parametrize("source", [_Flexible(), _BuiltinMethods()], ids=["defaults", "builtins"])
def test_methods_that_accept_the_calls_are_registered(source: object) -> None:
    detctx.register_source("fine", source)
    try:
        with detctx.deterministic(seed=1):
            pass
    finally:
        detctx.unregister_source("fine")


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


@pytest.mark.slow
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
