"""NumPy bit generators in checkpoints: every valid state comes back, no crafted one gets in."""

from __future__ import annotations

import copy
import io
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx

KINDS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")
Wrapper = Callable[[np.random.BitGenerator], Any]
WRAPPERS: dict[str, Wrapper] = {
    "Generator": np.random.Generator,
    "RandomState": np.random.RandomState,
}


def _through_a_file(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _array(values: np.ndarray[Any, Any]) -> dict[str, Any]:
    """An array as a state dict stores it (what a crafted checkpoint file would hold)."""
    return {
        "__ndarray__": values.dtype.str,
        "shape": list(values.shape),
        "data": torch.from_numpy(np.ascontiguousarray(values).reshape(-1).view(np.uint8).copy()),
    }


@pytest.fixture
def registered() -> Iterator[Callable[[Any], None]]:
    names: list[str] = []

    def register(rng: Any) -> None:
        detctx.register_source("augment", rng)
        names.append("augment")

    yield register
    for name in names:
        detctx.unregister_source(name)


def test_numpy_alone_crashes_on_a_philox_buffer_position_of_minus_10_to_the_8() -> None:
    # The attack, without detctx, in a child: the draw after the crafted state reads
    # 800 MB before the buffer. This is what the checks below keep out.
    attack = (
        "import numpy as np\n"
        "bit_generator = np.random.Philox(1)\n"
        "state = bit_generator.state\n"
        "state['buffer_pos'] = -10**8\n"
        "bit_generator.state = state\n"
        "print(np.random.Generator(bit_generator).random(3))\n"
    )
    child = subprocess.run([sys.executable, "-c", attack], capture_output=True, timeout=120)
    # NumPy 2.4 crashes; a NumPy that learns to refuse the value would say so instead.
    refused_by_numpy = child.returncode == 1 and b"buffer_pos" in child.stderr
    assert child.returncode == -signal.SIGSEGV or refused_by_numpy, child


@pytest.mark.slow
def test_a_checkpoint_with_that_position_is_refused_and_the_generator_draws_on() -> None:
    output = run_python(
        """
        import io, numpy as np, torch, detctx
        generator = np.random.Generator(np.random.Philox(1))
        detctx.register_source("augment", generator)
        saved = detctx.capture().state_dict()
        saved["sources"]["augment"]["state"]["buffer_pos"] = -10**8
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        crafted = torch.load(buffer, weights_only=True)
        expected = np.random.Generator(np.random.Philox(1)).random(1000)
        try:
            detctx.restore(crafted)
        except detctx.CheckpointError as exc:
            print("refused:", exc)
        print("same draws", bool(np.array_equal(generator.random(1000), expected)))
        """
    )
    assert "refused:" in output and "'augment'" in output and "buffer_pos" in output
    assert output.strip().endswith("same draws True")


def _set(*path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def corrupt(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value

    return corrupt


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.pop(key)


U64, U32 = np.uint64, np.uint32

# (bit generator, wrapper, field named in the error, corruption of the saved state)
CRAFTED: list[tuple[str, str, str, Callable[[dict[str, Any]], None]]] = [
    ("Philox", "Generator", "buffer_pos", _set("buffer_pos", value=-(10**8))),
    ("Philox", "Generator", "buffer_pos", _set("buffer_pos", value=-(2**31))),
    ("Philox", "Generator", "buffer_pos", _set("buffer_pos", value=-1)),
    ("Philox", "Generator", "buffer_pos", _set("buffer_pos", value=5)),
    ("Philox", "RandomState", "buffer_pos", _set("buffer_pos", value=-(10**8))),
    ("Philox", "Generator", "has_uint32", _set("has_uint32", value=7)),
    ("Philox", "Generator", "uinteger", _set("uinteger", value=2**40)),
    (
        "Philox",
        "Generator",
        "state.counter",
        _set("state", "counter", value=_array(np.ones(6, U64))),
    ),
    ("Philox", "Generator", "state.counter", _set("state", "counter", value=_array(np.ones(4)))),
    ("Philox", "Generator", "state.key", _set("state", "key", value=_array(np.ones(3, U64)))),
    ("Philox", "Generator", "buffer", _set("buffer", value=_array(np.ones(4, np.int64)))),
    ("Philox", "Generator", "layout.*lacks uinteger", _drop("uinteger")),
    ("Philox", "Generator", "layout.*unknown extra", _set("extra", value=1)),
    ("PCG64", "Generator", "state.state", _set("state", "state", value=2**128)),
    ("PCG64", "Generator", "state.state", _set("state", "state", value=-1)),
    ("PCG64", "Generator", "state.state", _set("state", "state", value=1.5)),
    ("PCG64", "Generator", "state.inc.*odd", _set("state", "inc", value=2)),
    ("PCG64", "RandomState", "has_uint32", _set("has_uint32", value=2)),
    ("PCG64DXSM", "Generator", "state.inc.*odd", _set("state", "inc", value=10**30)),
    ("PCG64DXSM", "Generator", "uinteger", _set("uinteger", value=-1)),
    ("SFC64", "Generator", "state.state", _set("state", "state", value=_array(np.ones(4)))),
    ("SFC64", "Generator", "state.state", _set("state", "state", value=_array(np.ones(5, U64)))),
    ("SFC64", "Generator", "has_uint32", _set("has_uint32", value=True)),
    ("MT19937", "Generator", "state.pos", _set("state", "pos", value=-1)),
    ("MT19937", "Generator", "state.pos", _set("state", "pos", value=625)),
    ("MT19937", "Generator", "state.key", _set("state", "key", value=_array(np.ones(700, U32)))),
    ("MT19937", "Generator", "state.key", _set("state", "key", value=_array(np.ones(624, U64)))),
    ("Philox", "RandomState", "has_gauss", _set("has_gauss", value=5)),
    ("SFC64", "RandomState", "gauss", _set("gauss", value=float("nan"))),
    ("PCG64", "RandomState", "layout.*has_gauss and gauss", _drop("gauss")),
]


@pytest.mark.parametrize(("kind", "wrapper", "field", "corrupt"), CRAFTED)
def test_a_crafted_bit_generator_state_is_refused_naming_the_field_with_nothing_changed(
    registered: Callable[[Any], None],
    kind: str,
    wrapper: str,
    field: str,
    corrupt: Callable[[dict[str, Any]], None],
) -> None:
    rng = WRAPPERS[wrapper](getattr(np.random, kind)(7))
    registered(rng)
    saved = detctx.capture().state_dict()
    crafted = copy.deepcopy(saved)
    corrupt(crafted["sources"]["augment"]["state"])
    before = (detctx.fingerprint(), _state_of(rng))

    with pytest.raises(detctx.CheckpointError, match=f"source 'augment'.*{field}"):
        detctx.restore(_through_a_file(crafted))

    assert detctx.fingerprint() == before[0]
    assert _same_state(_state_of(rng), before[1])
    detctx.restore(_through_a_file(saved))  # the untouched dict still restores


def _state_of(rng: Any) -> Any:
    if isinstance(rng, np.random.Generator):
        return rng.bit_generator.state
    return rng.get_state(legacy=False)


def _same_state(left: Any, right: Any) -> bool:
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_same_state(left[k], right[k]) for k in left)
    if isinstance(left, np.ndarray):
        return bool(np.array_equal(left, right)) and left.dtype == right.dtype
    return bool(left == right)


class _OwnPCG64(np.random.PCG64):
    """A bit generator of a type detctx has no checks for."""


def test_a_bit_generator_type_detctx_cannot_check_is_refused(
    registered: Callable[[Any], None],
) -> None:
    generator = np.random.Generator(_OwnPCG64(3))
    registered(generator)
    saved = detctx.capture().state_dict()
    before = generator.bit_generator.state

    with pytest.raises(detctx.CheckpointError, match=r"'augment'.*cannot check.*_OwnPCG64"):
        detctx.restore(_through_a_file(saved))

    assert generator.bit_generator.state == before


def _draw(rng: Any, count: int) -> np.ndarray[Any, Any]:
    if isinstance(rng, np.random.Generator):
        return np.concatenate([rng.random(count), rng.integers(0, 2**32, 3, dtype=np.uint32)])
    return np.concatenate([rng.random_sample(count), rng.standard_normal(3)])


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    wrapper=st.sampled_from(sorted(WRAPPERS)),
    seed=st.integers(0, 2**63),
    uniforms=st.integers(0, 1500),
    odd_words=st.integers(0, 3),
)
def test_every_bit_generator_state_round_trips_through_a_weights_only_checkpoint(
    kind: str, wrapper: str, seed: int, uniforms: int, odd_words: int
) -> None:
    rng = WRAPPERS[wrapper](getattr(np.random, kind)(seed))
    # Odd counts of 32-bit words and of Gaussians leave the buffered halves set.
    if isinstance(rng, np.random.Generator):
        rng.random(uniforms)
        rng.integers(0, 2**32, odd_words, dtype=np.uint32)
    else:
        rng.random_sample(uniforms)
        rng.standard_normal(odd_words)
    detctx.register_source("augment", rng)
    try:
        saved = _through_a_file(detctx.capture().state_dict())
        state = _state_of(rng)
        expected = _draw(rng, 7)

        detctx.restore(saved)

        assert _same_state(_state_of(rng), state)
        assert np.array_equal(_draw(rng, 7), expected)
    finally:
        detctx.unregister_source("augment")
