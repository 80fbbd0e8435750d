"""An RNG state dict carries a digest: a state that fits its source but is not the one saved
is refused before any RNG changes; dicts written before the digest (version 1) still load."""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import draws

import detctx


def save_and_load(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def flip_mersenne_word(state: dict[str, Any]) -> None:
    words = state["sources"]["python"]["state"]["internal"]
    words[100] ^= 1 << 7


def numpy_position_one_off(state: dict[str, Any]) -> None:
    entry = state["sources"]["numpy"]["state"]
    entry["pos"] = entry["pos"] - 1 if entry["pos"] > 0 else 1


def torch_state_byte(state: dict[str, Any]) -> None:
    state["sources"]["torch"]["state"][40] ^= 1


def gaussian_cache_set(state: dict[str, Any]) -> None:
    entry = state["sources"]["numpy"]["state"]
    entry["has_gauss"], entry["cached_gaussian"] = 1, 0.25


@pytest.mark.parametrize(
    "corrupt", [flip_mersenne_word, numpy_position_one_off, torch_state_byte, gaussian_cache_set]
)
def test_a_valid_state_other_than_the_saved_one_is_refused_with_nothing_changed(
    corrupt: Callable[[dict[str, Any]], None],
) -> None:
    random.random()
    np.random.rand()
    saved = save_and_load(detctx.capture().state_dict())
    corrupt(saved)
    # The corrupted states alone are ones their sources accept: only the digest tells.
    unchecked = {key: value for key, value in saved.items() if key != "digest"}
    detctx.Snapshot.from_state_dict({**copy.deepcopy(unchecked), "version": 1})
    before = detctx.fingerprint()

    with pytest.raises(detctx.CheckpointError, match="changed after it was saved"):
        detctx.restore(saved)
    with pytest.raises(detctx.CheckpointError, match="changed after it was saved"):
        detctx.Snapshot.from_state_dict(saved, strict=False)
    assert detctx.fingerprint() == before


def test_the_digest_is_checked_after_what_names_the_problem() -> None:
    state = detctx.capture().state_dict()
    state["sources"]["python"]["kind"] = "torch"
    state["sources"]["python"]["state"]["internal"][0] ^= 1

    with pytest.raises(detctx.CheckpointError, match="'torch' state for source 'python'"):
        detctx.restore(state)


def test_an_unchanged_dict_round_trips_through_a_file_with_its_digest() -> None:
    np.random.randn()  # a Gaussian cached
    state = save_and_load(detctx.capture().state_dict())
    expected = draws()

    detctx.restore(state)

    assert draws() == expected
    assert isinstance(state["digest"], str) and len(state["digest"]) == 32


def test_a_version_one_dict_without_a_digest_still_loads() -> None:
    state = detctx.capture().state_dict()
    expected = draws()
    del state["digest"]
    state["version"] = 1

    detctx.restore(save_and_load(state))

    assert draws() == expected


@pytest.mark.parametrize(
    ("version", "edit", "message"),
    [
        (2, lambda state: state.pop("digest"), r"version 2 holds keys \['format', 'sources'"),
        (1, lambda state: None, r"version 1 holds keys \['digest', 'format'"),
        (2, lambda state: state.update(note="x"), r"holds keys \['digest', 'format', 'note'"),
        (2, lambda state: state.update(digest=7), "changed after it was saved"),
        (2, lambda state: state.update(digest=torch.zeros(16)), "changed after it was saved"),
    ],
)
def test_a_dict_whose_keys_do_not_fit_its_version_is_refused(
    version: int, edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    state = detctx.capture().state_dict()
    state["version"] = version
    edit(state)
    before = detctx.fingerprint()

    with pytest.raises(detctx.CheckpointError, match=message):
        detctx.restore(state)
    assert detctx.fingerprint() == before


def test_a_resume_state_holds_the_rng_digest_too() -> None:
    loader = detctx.resumable_loader(list(range(8)), batch_size=2, shuffle=True)
    list(loader)
    state = save_and_load(detctx.resume_state(loader))

    assert state["rng"]["version"] == 2
    detctx.resume(state, loader)
