"""check_reproducible and check_gradients: prove it, or name the first difference."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import detctx


def forward_with_dropout() -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    logits = model(torch.randn(5, 4))
    return {"logits": logits, "noise": np.random.rand(3), "step": 7, "tags": ("a", None)}


def test_a_seeded_computation_is_proven_and_its_result_returned():
    result = detctx.check_reproducible(forward_with_dropout, runs=3, seed=42)

    with detctx.deterministic(seed=42):
        expected = forward_with_dropout()
    assert torch.equal(result["logits"], expected["logits"])
    assert np.array_equal(result["noise"], expected["noise"])


def test_the_callers_random_state_is_left_alone():
    torch.rand(2)
    before = detctx.fingerprint()

    detctx.check_reproducible(forward_with_dropout)

    assert detctx.fingerprint() == before


def test_os_entropy_is_caught_at_the_leaf_that_uses_it():
    def sample() -> dict[str, Any]:
        logits = [torch.rand(2) for _ in range(3)]
        logits.append(torch.from_numpy(np.random.default_rng().random((2, 3))))
        return {"loss": torch.rand(()), "logits": logits}

    with pytest.raises(detctx.NotReproducibleError) as caught:
        detctx.check_reproducible(sample)

    error = caught.value
    assert error.path == 'result["logits"][3]'
    assert error.mismatched == error.total == 6
    assert error.max_abs_diff is not None and 0 < error.max_abs_diff < 1
    assert 'result["logits"][3]: 6 of 6 elements differ' in str(error)


def test_a_time_seeded_generator_is_caught():
    def shuffled() -> list[int]:
        generator = torch.Generator().manual_seed(time.time_ns())
        return torch.randperm(1000, generator=generator).tolist()

    with pytest.raises(detctx.NotReproducibleError, match=r"result\[\d+\]"):
        detctx.check_reproducible(shuffled)


def test_an_extra_draw_on_the_second_run_shifts_the_result():
    calls = []

    def warm_cache_then_sample() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            torch.rand(1)  # e.g. a lazily built cache that draws once
        return torch.rand(4)

    with pytest.raises(detctx.NotReproducibleError) as caught:
        detctx.check_reproducible(warm_cache_then_sample)

    assert caught.value.path == "result"
    assert caught.value.run == 2


def test_a_run_that_consumes_more_randomness_is_reported_even_if_its_result_agrees():
    calls = []

    def sample_then_maybe_draw() -> torch.Tensor:
        calls.append(1)
        out = torch.rand(4)
        if len(calls) == 2:
            np.random.rand()
        return out

    with pytest.raises(detctx.NotReproducibleError, match="different amounts of randomness") as e:
        detctx.check_reproducible(sample_then_maybe_draw)
    assert e.value.path is None
    assert e.value.sources == ("numpy",)

    calls.clear()
    detctx.check_reproducible(sample_then_maybe_draw, check_rng=False)


def test_a_result_object_mutated_in_place_is_compared_run_by_run():
    buffer = torch.zeros(3)

    def fill() -> torch.Tensor:
        buffer.add_(1)
        return buffer

    with pytest.raises(detctx.NotReproducibleError, match="3 of 3 elements differ"):
        detctx.check_reproducible(fill)


def test_nan_at_the_same_place_agrees_but_the_sign_of_zero_does_not():
    detctx.check_reproducible(lambda: [math.nan, torch.tensor([math.nan, 1.0]), np.array([np.nan])])

    signs = iter([0.0, -0.0])
    with pytest.raises(detctx.NotReproducibleError, match="signs of zero differ") as caught:
        detctx.check_reproducible(lambda: torch.tensor([1.0, next(signs)]))
    assert caught.value.max_abs_diff == 0.0
    assert caught.value.mismatched == 1


@pytest.mark.parametrize(
    ("results", "reason"),
    [
        ([torch.zeros(2), torch.zeros(3)], "shapes differ"),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], "dtypes differ"),
        ([1, 1.0], "types differ"),
        ([{"a": 1}, {"b": 1}], "keys differ"),
        ([[1, 2], [1, 2, 3]], "lengths differ"),
        (["x", "y"], "'x' vs 'y'"),
        ([np.array(["a", "b"]), np.array(["a", "c"])], "1 of 2 elements differ"),
        ([torch.tensor([1, 2]), torch.tensor([1, 5])], "max abs difference 3"),
    ],
)
def test_every_kind_of_difference_is_described(results, reason):
    values = iter(results)
    with pytest.raises(detctx.NotReproducibleError, match=reason):
        detctx.check_reproducible(lambda: next(values))


def test_an_unknown_result_type_is_refused_clearly():
    with pytest.raises(TypeError, match="cannot compare result of type object"):
        detctx.check_reproducible(object)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"runs": 1}, ValueError), ({"runs": 2.0}, TypeError), ({"seed": -1}, ValueError)],
)
def test_bad_arguments_fail_before_fn_runs(kwargs, error):
    calls = []
    with pytest.raises(error):
        detctx.check_reproducible(lambda: calls.append(1), **kwargs)
    assert calls == []


def test_seed_none_uses_one_seed_for_every_run(monkeypatch):
    monkeypatch.delenv("DETCTX_SEED", raising=False)

    detctx.check_reproducible(forward_with_dropout, seed=None)


class NoisyBackward(torch.autograd.Function):
    """The identity forward; the backward adds noise from OS entropy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        noise = np.random.default_rng().random(tuple(grad.shape), dtype=np.float32)
        return grad + torch.from_numpy(noise)


class Net(nn.Module):
    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 1)
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.fc(x))
        if self.noisy:
            hidden = NoisyBackward.apply(hidden)
        return self.head(nn.functional.dropout(hidden, 0.2))


def test_gradients_are_compared_and_the_model_is_left_as_it_was():
    model = Net(noisy=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    result = detctx.check_gradients(model, torch.randn(6, 4), loss_fn=lambda out: out.pow(2).mean())

    assert set(result["grads"]) == {
        "fc.weight",
        "fc.bias",
        "norm.weight",
        "norm.bias",
        "head.weight",
        "head.bias",
    }
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_backward_pass_that_is_not_reproducible_is_named_by_parameter():
    with pytest.raises(detctx.NotReproducibleError) as caught:
        detctx.check_gradients(Net(noisy=True), torch.randn(6, 4))

    # The first parameter whose gradient flows through the noisy backward.
    assert caught.value.path == 'result["grads"]["fc.weight"]'


def test_check_gradients_wants_a_module():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        detctx.check_gradients(lambda x: x, torch.zeros(1))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * scale


def test_a_tuple_of_inputs_is_passed_unpacked_like_the_models_own_arguments():
    inputs = (torch.randn(3, 4), torch.full((3, 1), 2.0))

    result = detctx.check_gradients(TwoInputs(), *inputs)

    assert result["output"].shape == (3, 1)


def test_a_tuple_passed_without_unpacking_gets_told_to_unpack_it():
    model = TwoInputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = (torch.randn(3, 4), torch.full((3, 1), 2.0))

    with pytest.raises(TypeError, match=r"unpack it: check_gradients\(model, \*inputs\)"):
        detctx.check_gradients(model, inputs)

    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
