"""Variables that frameworks export while seeding do not outlive the block they ran in."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx
from detctx._environment import WATCHED

FRAMEWORK_VARIABLES = (
    "CUDA_LAUNCH_BLOCKING",
    "ASCEND_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "HCCL_DETERMINISTIC",
    "FLASH_ATTENTION_DETERMINISTIC",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)


@pytest.fixture
def clean_environment(monkeypatch):
    for name in FRAMEWORK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def environment_of(names=FRAMEWORK_VARIABLES):
    return {name: os.environ.get(name) for name in names}


def test_enable_full_determinism_inside_a_block_leaves_no_variable_set_after_it(
    clean_environment,
):
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    with detctx.deterministic(seed=3):
        trainer_utils.enable_full_determinism(3)
        assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
        assert os.environ["ASCEND_LAUNCH_BLOCKING"] == "1"
    assert environment_of() == dict.fromkeys(FRAMEWORK_VARIABLES)


def test_enable_full_determinism_inside_a_block_puts_the_users_own_values_back(
    clean_environment,
):
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    clean_environment.setenv("CUDA_LAUNCH_BLOCKING", "0")
    clean_environment.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    before = environment_of()
    with detctx.deterministic(seed=3, hccl=False, flash_attention=False):
        trainer_utils.enable_full_determinism(3)
    assert environment_of() == before


def test_seed_everything_inside_a_block_leaves_no_lightning_seed_behind(clean_environment):
    seed_module = pytest.importorskip("lightning.fabric.utilities.seed")
    with detctx.deterministic(seed=5):
        seed_module.seed_everything(42, workers=True, verbose=False)
        assert os.environ["PL_GLOBAL_SEED"] == "42"
        assert os.environ["PL_SEED_WORKERS"] == "1"
    assert os.environ.get("PL_GLOBAL_SEED") is None
    assert os.environ.get("PL_SEED_WORKERS") is None


def test_a_seed_everything_before_the_block_survives_one_inside_it(clean_environment):
    seed_module = pytest.importorskip("lightning.fabric.utilities.seed")
    seed_module.seed_everything(7, workers=False, verbose=False)
    with detctx.deterministic(seed=5):
        seed_module.seed_everything(42, workers=True, verbose=False)
    assert os.environ["PL_GLOBAL_SEED"] == "7"
    assert os.environ["PL_SEED_WORKERS"] == "0"


def test_a_block_that_raises_still_puts_the_watched_variables_back(clean_environment):
    with pytest.raises(KeyError), detctx.deterministic(seed=1):
        os.environ["PL_GLOBAL_SEED"] = "99"
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        raise KeyError("boom")
    assert environment_of() == dict.fromkeys(FRAMEWORK_VARIABLES)


def test_a_decorated_generator_keeps_its_framework_variables_to_itself(clean_environment):
    @detctx.deterministic(seed=2)
    def steps():
        os.environ["PL_GLOBAL_SEED"] = "11"
        yield os.environ.get("PL_GLOBAL_SEED")
        yield os.environ.get("PL_GLOBAL_SEED")

    clean_environment.setenv("PL_GLOBAL_SEED", "1")
    gen = steps()
    assert next(gen) == "11"
    assert os.environ["PL_GLOBAL_SEED"] == "1"
    os.environ["PL_GLOBAL_SEED"] = "2"  # the caller's change between steps is the caller's
    assert next(gen) == "11"
    assert os.environ["PL_GLOBAL_SEED"] == "2"


values = st.one_of(st.none(), st.sampled_from(["0", "1", "42", ""]), st.text(max_size=8))
variable_states = st.fixed_dictionaries({name: values for name in WATCHED.variables})


def without_nul(state):
    return {name: (v if v is None else v.replace("\0", "")) for name, v in state.items()}


def set_environment(state):
    for name, value in state.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@settings(max_examples=40, deadline=None)
@given(before=variable_states.map(without_nul), inside=variable_states.map(without_nul))
def test_whatever_the_body_writes_the_watched_variables_return_to_their_values_before(
    before, inside
):
    saved = environment_of(WATCHED.variables)
    try:
        set_environment(before)
        with detctx.deterministic(seed=0):
            set_environment(inside)
            assert environment_of(WATCHED.variables) == inside
        assert environment_of(WATCHED.variables) == before
    finally:
        set_environment(saved)


def test_detctx_capture_leaves_the_environment_out_of_a_checkpointable_snapshot(
    clean_environment,
):
    state = detctx.capture()
    os.environ["PL_GLOBAL_SEED"] = "3"
    state.restore()
    assert os.environ["PL_GLOBAL_SEED"] == "3"
    assert "watched environment" not in state.state_dict()
