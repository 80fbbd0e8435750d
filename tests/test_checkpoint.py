"""Checkpointing RNG state: plain data that survives torch.load(weights_only=True)."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_python
from helpers import draws

import detctx
from detctx._state.state_dict import VERSION


def save_and_load(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_plain(value: Any, where: str = "state_dict") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"non-string key at {where}"
            assert_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            assert_plain(item, f"{where}[{index}]")
    else:
        assert value is None or type(value) in (bool, int, float, str, torch.Tensor), (
            f"{where} is a {type(value).__name__}"
        )


class CounterSource:
    """A user RNG whose captured state is already plain data."""

    def __init__(self) -> None:
        self.state = {"counter": 0, "history": [1, 2]}

    def capture(self) -> Any:
        return {"counter": self.state["counter"], "history": list(self.state["history"])}

    def restore(self, state: Any) -> None:
        self.state = {"counter": state["counter"], "history": list(state["history"])}

    def seed(self, seed: int) -> None:
        self.state = {"counter": seed, "history": []}

    def random(self) -> float:
        self.state["counter"] += 1
        self.state["history"].append(self.state["counter"])
        return float(self.state["counter"])


class FrozenSetSource(CounterSource):
    """A user RNG whose state is not plain, with its own conversion."""

    def capture(self) -> Any:
        return frozenset([self.state["counter"]])

    def restore(self, state: Any) -> None:
        (self.state["counter"],) = state

    def state_to_plain(self, state: Any) -> Any:
        return {"counter": next(iter(state))}

    def state_from_plain(self, plain: Any) -> Any:
        return frozenset([plain["counter"]])


@pytest.fixture
def user_sources() -> Iterator[list[Any]]:
    generators: dict[str, Any] = {
        "sampler": torch.Generator().manual_seed(3),
        "augment": random.Random(4),
        "legacy": np.random.RandomState(5),
        "pcg": np.random.default_rng(6),
        "philox": np.random.Generator(np.random.Philox(7)),
        "counter": CounterSource(),
        "frozen": FrozenSetSource(),
    }
    for name, generator in generators.items():
        detctx.register_source(name, generator)
    try:
        yield list(generators.values())
    finally:
        for name in generators:
            detctx.unregister_source(name)


def test_every_kind_of_source_round_trips_through_a_weights_only_load(user_sources):
    draws(*user_sources)  # move every stream off its seed, Gaussian caches included
    np.random.randn()
    saved = detctx.capture()
    expected = draws(*user_sources)

    loaded = save_and_load(saved.state_dict())
    detctx.restore(loaded)

    assert draws(*user_sources) == expected
    assert detctx.Snapshot.from_state_dict(loaded).fingerprint() == saved.fingerprint()


def test_the_state_dict_holds_only_tensors_numbers_strings_lists_and_dicts(user_sources):
    state_dict = detctx.capture().state_dict()

    assert_plain(state_dict)
    assert state_dict["format"] == "detctx.RNGState"
    assert state_dict["version"] == VERSION
    kinds = {name: entry["kind"] for name, entry in state_dict["sources"].items()}
    assert kinds["python"] == "python"
    assert kinds["numpy"] == "numpy-legacy"
    assert kinds["torch"] == "torch"
    assert kinds["pcg"] == kinds["philox"] == "numpy-bitgen"
    assert kinds["counter"] == "plain"
    assert kinds["frozen"] == "custom"


def test_restoring_inside_a_block_continues_the_saved_streams():
    with detctx.deterministic(seed=11):
        torch.rand(3)
        state_dict = save_and_load(detctx.capture().state_dict())
        expected = draws()
    with detctx.deterministic(seed=99):
        detctx.restore(state_dict)
        assert draws() == expected


def test_a_dict_from_a_newer_format_version_is_refused_before_anything_changes():
    state_dict = detctx.capture().state_dict()
    state_dict["version"] = VERSION + 1
    random.random()
    before = detctx.fingerprint()

    with pytest.raises(detctx.CheckpointError, match="newer detctx"):
        detctx.restore(state_dict)
    assert detctx.fingerprint() == before


@pytest.mark.parametrize(
    "not_a_state_dict",
    [{"python": 1}, [], "state", {"format": "detctx.RNGState", "version": "1", "sources": {}}],
)
def test_something_that_is_not_a_state_dict_is_refused(not_a_state_dict):
    with pytest.raises(detctx.CheckpointError):
        detctx.restore(not_a_state_dict)


def test_a_saved_source_that_is_not_registered_here_is_named():
    detctx.register_source("sampler", torch.Generator())
    try:
        state_dict = detctx.capture().state_dict()
    finally:
        detctx.unregister_source("sampler")
    before = detctx.fingerprint()

    with pytest.raises(detctx.CheckpointError, match=r"register_source\('sampler'"):
        detctx.restore(state_dict)
    assert detctx.fingerprint() == before

    detctx.restore(state_dict, strict=False)  # the other sources are restored


def test_a_source_registered_here_but_missing_from_the_dict_needs_strict_false():
    state_dict = detctx.capture().state_dict()
    sampler = torch.Generator().manual_seed(1)
    detctx.register_source("sampler", sampler)
    try:
        with pytest.raises(detctx.CheckpointError, match=r"'sampler'.*strict=False"):
            detctx.restore(state_dict)
        sampler_state = sampler.get_state()
        detctx.restore(state_dict, strict=False)
        assert torch.equal(sampler.get_state(), sampler_state)
    finally:
        detctx.unregister_source("sampler")


def test_a_state_for_a_different_kind_of_rng_is_refused():
    detctx.register_source("sampler", torch.Generator())
    try:
        state_dict = detctx.capture().state_dict()
    finally:
        detctx.unregister_source("sampler")
    detctx.register_source("sampler", random.Random())
    try:
        with pytest.raises(detctx.CheckpointError, match="'torch' state for source 'sampler'"):
            detctx.restore(state_dict)
    finally:
        detctx.unregister_source("sampler")


def test_a_user_state_that_is_not_plain_data_asks_for_a_conversion():
    class SetSource(CounterSource):
        def capture(self) -> Any:
            return {self.state["counter"]}

    detctx.register_source("sets", SetSource())
    try:
        with pytest.raises(detctx.CheckpointError, match="state_to_plain"):
            detctx.capture().state_dict()
    finally:
        detctx.unregister_source("sets")


def test_a_truncated_python_state_is_reported_as_malformed():
    state_dict = detctx.capture().state_dict()
    state_dict["sources"]["python"]["state"]["internal"] = torch.arange(3)

    with pytest.raises(detctx.CheckpointError, match="'python' state for source 'python'"):
        detctx.Snapshot.from_state_dict(state_dict)


@pytest.mark.slow
def test_accelerator_states_round_trip_initialised_or_not():
    output = run_python(
        """
        import io, json, torch, detctx, simulated_npu
        simulated_npu.install(2)

        def round_trip(state):
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            buffer.seek(0)
            return torch.load(buffer, weights_only=True)

        with detctx.deterministic(seed=5):
            pending = round_trip(detctx.capture())
        simulated_npu.rand(1, device=1)
        saved = round_trip(detctx.capture())
        expected = [simulated_npu.rand(2, device=d).tolist() for d in (0, 1)]
        detctx.restore(saved)
        again = [simulated_npu.rand(2, device=d).tolist() for d in (0, 1)]
        print(json.dumps({
            "pending": pending["sources"]["npu"],
            "kind": saved["sources"]["npu"]["kind"],
            "devices": len(saved["sources"]["npu"]["state"]["devices"]),
            "same": expected == again,
        }))
        """
    )
    report = json.loads(output)
    assert report["pending"] == {
        "kind": "accelerator-uninitialised",
        "state": {"seed_before": 5},
    }
    assert report["kind"] == "accelerator"
    assert report["devices"] == 2
    assert report["same"] is True


RESUME_SCRIPT = """
import json, random, sys
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import detctx

N = 6  # two epochs of three batches: the checkpoint falls on an epoch boundary
torch.set_num_threads(1)  # a tiny model: spare threads only spin on a busy machine

def build():
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.25), nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)

generator = torch.Generator()
detctx.register_source("loader", generator)
data = TensorDataset(torch.linspace(-1, 1, 48).reshape(12, 4), torch.linspace(0, 1, 12)[:, None])
loader = DataLoader(data, batch_size=4, shuffle=True, generator=generator)

def train(model, optimiser, steps):
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            x = x + torch.from_numpy(np.random.normal(0, 0.05, x.shape).astype(np.float32))
            x = x * (1 + 0.1 * random.random())
            loss = ((model(x) - y) ** 2).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item().hex())
    return losses

path = sys.argv[2]
if sys.argv[1] == "first":
    with detctx.deterministic(seed=1234):
        straight = train(*build(), 2 * N)
    with detctx.deterministic(seed=1234):
        model, optimiser = build()
        first = train(model, optimiser, N)
        torch.save(
            {"model": model.state_dict(), "optimiser": optimiser.state_dict(),
             "rng": detctx.capture().state_dict()},
            path,
        )
    print(json.dumps({"straight": straight, "first": first}))
else:
    with detctx.deterministic(seed=1234):
        model, optimiser = build()
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimiser.load_state_dict(checkpoint["optimiser"])
        detctx.restore(checkpoint["rng"])
        print(json.dumps({"resumed": train(model, optimiser, N)}))
"""


@pytest.mark.slow
def test_training_resumed_from_a_checkpoint_in_a_fresh_process_matches_a_straight_run(
    tmp_path,
):
    script = tmp_path / "train.py"
    script.write_text(RESUME_SCRIPT)
    checkpoint = tmp_path / "checkpoint.pt"

    first_process = json.loads(run_python(script.read_text(), "first", str(checkpoint)))
    second_process = json.loads(run_python(script.read_text(), "resume", str(checkpoint)))

    straight = first_process["straight"]
    assert len(straight) == 12
    assert first_process["first"] + second_process["resumed"] == straight
