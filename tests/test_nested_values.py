"""One walker over nested values and one canonical byte form: a namedtuple or a dataclass works
in every checker, and two values give the same bytes only when they are equal."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import detctx
from detctx._basics import nested
from detctx._state import canonical_bytes


class Out(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Step:
    loss: torch.Tensor
    extras: dict[str, Any]


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> Out:
        hidden = torch.dropout(self.fc(x), 0.5, True)
        return Out(logits=hidden * 2, hidden=hidden)


def test_check_gradients_takes_a_model_whose_output_is_a_namedtuple() -> None:
    torch.manual_seed(0)
    model = TwoHeads()

    result = detctx.check_gradients(
        model, torch.ones(4, 3), loss_fn=lambda out: out.logits.sum() + out.hidden.pow(2).sum()
    )

    assert isinstance(result["output"], Out)
    assert not result["output"].logits.requires_grad
    assert set(result["grads"]) == {"fc.weight", "fc.bias"}


def test_check_reproducible_names_the_field_of_a_dataclass_result_that_differs() -> None:
    calls = iter(range(10))

    def step() -> Step:
        return Step(loss=torch.tensor(1.0), extras={"count": next(calls)})

    with pytest.raises(detctx.NotReproducibleError) as caught:
        detctx.check_reproducible(step)

    assert caught.value.path == 'result.extras["count"]'


def test_a_dataclass_and_a_namedtuple_result_that_reproduce_are_returned_as_they_are() -> None:
    def step() -> tuple[Step, Out]:
        x = torch.rand(3)
        return Step(loss=x.sum(), extras={"x": x}), Out(logits=x, hidden=x * 2)

    first = detctx.check_reproducible(step)

    assert isinstance(first[0], Step) and isinstance(first[1], Out)


def test_tensors_of_one_content_in_two_shapes_give_different_bytes() -> None:
    data = torch.arange(6, dtype=torch.uint8)

    assert canonical_bytes(data.reshape(2, 3)) != canonical_bytes(data.reshape(3, 2))
    assert canonical_bytes(data.reshape(2, 3)) == canonical_bytes(data.clone().reshape(2, 3))
    assert canonical_bytes(data) != canonical_bytes(data.to(torch.int8))


class HeldState:
    """A user source whose state is whatever the test puts there."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def capture(self) -> Any:
        return self.state

    def restore(self, state: Any) -> None:
        self.state = state

    def seed(self, seed: int) -> None:
        self.state = seed


@pytest.fixture
def held() -> Any:
    source = HeldState(0)
    detctx.register_source("held", source)
    yield source
    detctx.unregister_source("held")


def snapshot_of(source: HeldState, state: Any) -> detctx.Snapshot:
    source.state = state
    return detctx.capture()


def test_crafted_user_states_whose_parts_run_together_are_told_apart(held: HeldState) -> None:
    # The first array's bytes spell the header of the next part: without a length prefix
    # (array, empty) and (empty, array) wrote the same bytes.
    header = np.frombuffer(b"Auint8", dtype=np.uint8)
    empty = np.zeros(0, dtype=np.uint8)

    one, other = snapshot_of(held, (header, empty)), snapshot_of(held, (empty, header))

    assert one != other
    assert one.fingerprint() != other.fingerprint()


def test_user_states_that_differ_only_in_shape_are_told_apart(held: HeldState) -> None:
    data = torch.arange(6, dtype=torch.uint8)

    wide, tall = snapshot_of(held, data.reshape(2, 3)), snapshot_of(held, data.reshape(3, 2))

    assert wide != tall and wide.fingerprint() != tall.fingerprint()


def test_a_list_and_a_tuple_and_a_bool_and_an_int_are_told_apart() -> None:
    assert canonical_bytes([1, 2]) != canonical_bytes((1, 2))
    assert canonical_bytes([True]) != canonical_bytes([1])
    assert canonical_bytes({"a": 1}) == canonical_bytes({"a": 1})
    assert canonical_bytes({1: "a", 2: "b"}) == canonical_bytes({2: "b", 1: "a"})


leaf_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.binary(max_size=5),
)
values = st.recursive(
    leaf_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.frozensets(st.text(max_size=3), max_size=3),
    ),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (1 == True == 1.0 in Python)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return bool(a == b)


@given(values, values)
def test_two_values_give_the_same_bytes_exactly_when_they_are_the_same(a: Any, b: Any) -> None:
    assert (canonical_bytes(a) == canonical_bytes(b)) == same(a, b)


@given(values)
def test_the_walker_rebuilds_every_container_in_its_own_type(value: Any) -> None:
    rebuilt = nested.map_leaves(lambda leaf: leaf, value)

    assert same(rebuilt, value)
    assert list(nested.leaves(rebuilt)) == list(nested.leaves(value))
