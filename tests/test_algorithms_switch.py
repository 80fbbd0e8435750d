"""The algorithms switch: torch's flags and inductor's `deterministic`, inductor never imported."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch._inductor.config as inductor_config
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx

VARIABLE = "TORCHINDUCTOR_DETERMINISTIC"

# Older torch (2.1) has neither: detctx leaves them alone there (detctx/_environment/inductor.py).
needs_inductor_setting = pytest.mark.skipif(
    not hasattr(inductor_config, "deterministic"),
    reason="this torch's inductor has no deterministic setting",
)
needs_fill_switch = pytest.mark.skipif(
    importlib.util.find_spec("torch.utils.deterministic") is None,
    reason="this torch has no torch.utils.deterministic.fill_uninitialized_memory",
)


@pytest.mark.slow
@needs_fill_switch
def test_a_first_block_in_a_fresh_process_does_not_import_inductor() -> None:
    out = run_python(
        """
        import json, os, sys, warnings
        import torch, detctx
        import torch.utils.deterministic as det

        os.environ.pop("TORCHINDUCTOR_DETERMINISTIC", None)
        det.fill_uninitialized_memory = False
        with detctx.deterministic(seed=0):
            on = (torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled(),
                  os.environ.get("TORCHINDUCTOR_DETERMINISTIC"))
            det.fill_uninitialized_memory = True
        with detctx.deterministic(seed=0, algorithms="warn"):
            warn = (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled())
        after = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled(),
                 os.environ.get("TORCHINDUCTOR_DETERMINISTIC"),
                 det.fill_uninitialized_memory)
        print(json.dumps({"inductor": "torch._inductor" in sys.modules,
                          "on": on, "warn": warn, "after": after}))
        """
    )
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["inductor"] is False
    assert seen["on"] == [True, False, "1"]
    assert seen["warn"] == [True, True]
    assert seen["after"] == [False, False, None, False]


@pytest.mark.slow
@needs_inductor_setting
def test_torch_compile_inside_a_block_compiles_deterministically_and_not_after() -> None:
    out = run_python(
        """
        import json, os, sys
        import torch, detctx

        os.environ.pop("TORCHINDUCTOR_DETERMINISTIC", None)
        compiled_with = []

        def recording(graph, example_inputs):
            import torch._inductor.config as config
            compiled_with.append(config.deterministic)
            return graph.forward

        with detctx.deterministic(seed=0):
            torch.compile(lambda x: torch.sin(x) * 2, backend=recording)(torch.ones(3))
            inside = torch._inductor.config.deterministic
        torch.compile(lambda x: torch.cos(x) * 2, backend=recording)(torch.ones(3))
        print(json.dumps({"compiled_with": compiled_with, "inside": inside,
                          "after": torch._inductor.config.deterministic,
                          "variable": os.environ.get("TORCHINDUCTOR_DETERMINISTIC")}))
        """,
        timeout=300,
    )
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["compiled_with"] == [True, False]
    assert (seen["inside"], seen["after"], seen["variable"]) == (True, False, None)


@needs_inductor_setting
def test_inductor_already_imported_follows_the_block_and_gets_its_value_back() -> None:
    inductor_config.deterministic = False
    with detctx.deterministic(seed=0):
        assert inductor_config.deterministic is True
        with detctx.deterministic(seed=1, algorithms=False):
            assert inductor_config.deterministic is True
    assert inductor_config.deterministic is False
    assert VARIABLE not in os.environ


@needs_inductor_setting
def test_seed_all_leaves_inductor_deterministic_like_torchs_own_call() -> None:
    inductor_config.deterministic = False
    try:
        detctx.seed_all(5)
        assert inductor_config.deterministic is True
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        os.environ.pop(VARIABLE, None)
        inductor_config.deterministic = False


@needs_inductor_setting
@settings(max_examples=40, deadline=None)
@given(
    enabled=st.booleans(),
    warn_only=st.booleans(),
    variable=st.sampled_from([None, "1", "0", " 1"]),
    compiled_deterministic=st.booleans(),
    setting=st.sampled_from([True, "warn", False]),
    change_inside=st.booleans(),
)
def test_every_algorithms_state_is_put_back_exactly_after_a_block(
    enabled: bool,
    warn_only: bool,
    variable: str | None,
    compiled_deterministic: bool,
    setting: bool | str,
    change_inside: bool,
) -> None:
    torch._C._set_deterministic_algorithms(enabled, warn_only=warn_only)
    inductor_config.deterministic = compiled_deterministic
    if variable is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = variable
    try:
        with detctx.deterministic(seed=0, algorithms=setting):  # type: ignore[arg-type]
            if setting is not False:
                assert torch.are_deterministic_algorithms_enabled()
                assert torch.is_deterministic_algorithms_warn_only_enabled() == (setting == "warn")
                assert inductor_config.deterministic is True
            if change_inside:
                torch.use_deterministic_algorithms(not enabled)
                os.environ[VARIABLE] = "changed"
        assert torch.are_deterministic_algorithms_enabled() == enabled
        assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
        assert inductor_config.deterministic == compiled_deterministic
        assert os.environ.get(VARIABLE) == variable
    finally:
        os.environ.pop(VARIABLE, None)
        inductor_config.deterministic = False


@settings(max_examples=60, deadline=None)
@given(
    # No NUL and no lone surrogate: os.environ cannot hold either.
    before=st.one_of(
        st.none(),
        st.text(
            st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=8
        ),
    ),
    inside=st.sampled_from([True, False]),
)
def test_a_variable_a_block_sets_is_seen_by_os_environ_and_by_children_then_put_back(
    before: str | None, inside: bool
) -> None:
    name = "FLASH_ATTENTION_DETERMINISTIC"
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before
    try:
        with detctx.deterministic(seed=0, flash_attention=inside):
            seen = os.environ.get(name)
            assert os.getenv(name) == seen
            assert (seen or "").strip() == "1" if inside else seen == before
        assert os.environ.get(name) == before
    finally:
        os.environ.pop(name, None)


def test_a_child_process_started_inside_a_block_inherits_its_variables() -> None:
    with detctx.deterministic(seed=7):
        out = run_python(
            "import os; print(os.environ['PYTHONHASHSEED'], os.environ['HCCL_DETERMINISTIC'])"
        )
    assert out.split() == ["7", "true"]
    assert "HCCL_DETERMINISTIC" not in os.environ
