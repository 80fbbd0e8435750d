"""A resume state is one checked envelope: an edit or a corruption of any part of it, the main
process's RNG states included, is refused with nothing changed."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx
from detctx import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
needs_torchdata = pytest.mark.skipif(
    importlib.util.find_spec("torchdata") is None, reason="needs torchdata"
)


class Items(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item()])


def elastic() -> Any:
    return detctx.elastic_loader(Items(), batch_size=4, seed=3)


def resumable() -> Any:
    return detctx.resumable_loader(Items(), batch_size=4, shuffle=True, seed=3)


def saved(build: Callable[[], Any]) -> dict[str, Any]:
    """A resume state saved after the first batch, with the main process's streams moved on."""
    with detctx.deterministic(seed=1):
        loader = build()
        next(iter(loader))
        return detctx.resume_state(loader)


def refused_unchanged(state: dict[str, Any], loader: Any, match: str) -> None:
    before, position = detctx.fingerprint(), copy.deepcopy(loader.state_dict())
    with pytest.raises(CheckpointError, match=match):
        detctx.resume(state, loader)
    assert detctx.fingerprint() == before
    assert same(loader.state_dict(), position)


def same(first: Any, second: Any) -> bool:
    if isinstance(first, dict):
        return (
            isinstance(second, dict)
            and first.keys() == second.keys()
            and all(same(first[key], second[key]) for key in first)
        )
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.equal(first, second)
    return bool(first == second)


STATE_TENSORS = {
    "python": lambda rng: rng["sources"]["python"]["state"]["internal"],
    "numpy": lambda rng: rng["sources"]["numpy"]["state"]["key"],
    "torch": lambda rng: rng["sources"]["torch"]["state"],
}


@settings(max_examples=60, deadline=None)
@given(
    source=st.sampled_from(sorted(STATE_TENSORS)),
    place=st.floats(min_value=0, max_value=1, exclude_max=True),
    bit=st.integers(min_value=0, max_value=7),
)
def test_one_flipped_bit_anywhere_in_the_saved_rng_states_is_refused_with_nothing_changed(
    source: str, place: float, bit: int
) -> None:
    state = saved(elastic)
    words = STATE_TENSORS[source](state["rng"])
    raw = words.view(torch.uint8)  # every byte of the state, whatever its dtype
    raw[int(place * raw.numel())] ^= 1 << bit
    # A value no stream can hold (a NumPy word over 32 bits) is refused by its source's checks
    # first; every other flip, by the digest.
    refused_unchanged(state, elastic(), "changed after it was saved|invalid")


def test_a_crafted_numpy_or_python_position_or_gaussian_cache_is_refused_with_nothing_changed() -> (
    None
):
    def numpy_state(state: dict[str, Any]) -> dict[str, Any]:
        found: dict[str, Any] = state["rng"]["sources"]["numpy"]["state"]
        return found

    def numpy_position(step: int) -> Callable[[dict[str, Any]], None]:
        def edit(state: dict[str, Any]) -> None:
            numpy_state(state)["pos"] = (numpy_state(state)["pos"] + step) % 625  # valid

        return edit

    def python_position(state: dict[str, Any]) -> None:
        internal = state["rng"]["sources"]["python"]["state"]["internal"]
        internal[-1] = (internal[-1] + 1) % 625  # a valid position, one word off

    def gaussian_cache(state: dict[str, Any]) -> None:
        numpy_state(state)["has_gauss"] = 1  # the next randn would return the cached 0.0

    for edit in (numpy_position(1), numpy_position(-1), python_position, gaussian_cache):
        state = saved(elastic)
        edit(state)
        refused_unchanged(state, elastic(), "changed after it was saved")


def test_an_elastic_position_edited_within_its_epoch_is_refused_in_a_resume_state() -> None:
    state = saved(elastic)
    state["loaders"][0]["consumed"] = 8  # in range, and another batch than the saved one
    refused_unchanged(state, elastic(), "changed after it was saved")


@needs_torchdata
def test_an_edited_rng_state_beside_a_resumable_loader_is_refused_and_the_loader_not_loaded() -> (
    None
):
    state = saved(resumable)
    state["rng"]["sources"]["numpy"]["state"]["pos"] -= 1
    loader = resumable()
    refused_unchanged(state, loader, "changed after it was saved")
    assert loader.next_iter_state is None


def test_a_missing_or_extra_entry_or_a_digest_of_another_kind_is_refused() -> None:
    good = saved(elastic)
    without = {key: value for key, value in good.items() if key != "digest"}
    cases = [
        (without, "holds keys"),
        ({**good, "extra": 0}, "holds keys"),
        ({**good, "digest": torch.zeros(16, dtype=torch.uint8)}, "changed after it was saved"),
        ({**good, "digest": good["digest"].upper()}, "changed after it was saved"),
    ]
    for state, match in cases:
        refused_unchanged(state, elastic(), match)


def test_a_resume_state_of_version_1_without_a_digest_is_refused_naming_how_to_take_it_anyway() -> (
    None
):
    good = saved(elastic)
    old = {key: value for key, value in good.items() if key != "digest"}
    old["version"] = 1
    refused_unchanged(old, elastic(), "version 1, saved before resume states carried a digest")
    with pytest.raises(CheckpointError, match=r"Snapshot.from_state_dict\(state\['rng'\]\)"):
        detctx.resume(old, elastic())

    # What the message says to do, unchecked, continues as resume() would have.
    with detctx.deterministic(seed=2):
        loader = elastic()
        detctx.resume(good, loader)
        expected = [torch.rand(2), *(batch.clone() for batch in loader)]
    with detctx.deterministic(seed=2):
        loader = elastic()
        detctx.Snapshot.from_state_dict(old["rng"]).restore()
        loader.load_state_dict(old["loaders"][0])
        taken = [torch.rand(2), *(batch.clone() for batch in loader)]
    assert all(torch.equal(a, b) for a, b in zip(expected, taken, strict=True))


def test_an_unedited_state_resumes_after_torch_save_and_a_weights_only_load(
    tmp_path: Any,
) -> None:
    with detctx.deterministic(seed=1):
        loader = elastic()
        next(iter(loader))
        torch.save({"detctx": detctx.resume_state(loader)}, tmp_path / "checkpoint.pt")
        draws = torch.rand(3)
        rest = [batch.clone() for batch in loader]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["detctx"]
    with detctx.deterministic(seed=2):
        again = elastic()
        detctx.resume(state, again)
        assert torch.equal(torch.rand(3), draws)
        assert all(torch.equal(a, b) for a, b in zip(rest, again, strict=True))


def test_a_resume_state_mixed_from_two_ranks_names_dcp_resume_state_where_dcp_is_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.distributed.checkpoint loads each key every rank saved from one rank's copy: rank 1
    # gets rank 0's RNG states beside its own loader position and digest.
    rank_1 = saved(elastic)
    with detctx.deterministic(seed=2):
        rank_0 = detctx.resume_state(elastic())
    mixed = {**rank_1, "rng": rank_0["rng"]}
    import torch.distributed.checkpoint  # noqa: F401

    refused_unchanged(mixed, elastic(), r"changed after it was saved.*dcp_resume_state\(loaders\)")
    monkeypatch.delitem(sys.modules, "torch.distributed.checkpoint")  # a program without DCP
    with pytest.raises(CheckpointError) as plain:
        detctx.resume(mixed, elastic())
    assert "dcp_resume_state" not in str(plain.value)


def test_digesting_a_state_leaves_its_tensors_memory_resizable() -> None:
    # The digest reads a copy's bytes: a tensor NumPy has seen can never be resized again
    # (torch 2.13), which FSDP2 does to its parameters' storages.
    from detctx._basics import plain_digest

    weights = torch.zeros(16)
    plain_digest({"weights": weights, "nested": [weights[4:]]})
    weights.untyped_storage().resize_(0)
    assert weights.untyped_storage().nbytes() == 0
