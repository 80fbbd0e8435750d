"""A determinism variable set with stray whitespace or another letter case.

torch compares ``CUBLAS_WORKSPACE_CONFIG`` with ``:4096:8`` and ``:16:8`` as
written, so ``' :16:8'`` kept verbatim made every cuBLAS op under
deterministic algorithms raise inside the block, and ``detctx doctor``
disagreed with the block. One rule now: the block, ``detctx run`` and the
doctor all take such a value for the exact value it stands for.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import detctx
from detctx._cli.run import determinism_env
from detctx._environment import env_switches
from detctx._proving.doctor import Diagnosis, advise

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
CUDA = [{"type": "cuda", "count": 1, "initialised": False}]
NPU = [{"type": "npu", "count": 1, "initialised": False}]
STRAY = [" :16:8", ":16:8 ", ":16:8\n", "\t:4096:8", ":4096:8\r\n"]

padding = st.text(alphabet=" \t\n\r\x0b\x0c", max_size=3)


def doctor_says(devices: list[dict[str, object]], **environment: str) -> str:
    report = Diagnosis({}, devices, {}, {"PYTHONHASHSEED": "0", **environment})
    return "\n".join(advise(report))


@pytest.mark.parametrize("value", STRAY, ids=repr)
def test_inside_a_block_a_cublas_value_with_stray_whitespace_is_the_exact_value(value: str):
    os.environ[CUBLAS] = value

    with detctx.deterministic(seed=1):
        inside = os.environ[CUBLAS]

    assert inside == value.strip()
    assert os.environ[CUBLAS] == value


@pytest.mark.parametrize("value", STRAY, ids=repr)
def test_detctx_run_exports_the_exact_value_a_stray_cublas_value_stands_for(value: str):
    env = determinism_env(7, {CUBLAS: value})

    assert env[CUBLAS] == value.strip()


def test_a_hash_seed_with_a_trailing_space_no_longer_reaches_a_child_python():
    # Python refuses to start with PYTHONHASHSEED='5 ' ("must be random or an integer").
    env = determinism_env(5, {**os.environ, "PYTHONHASHSEED": "5 "})

    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ['PYTHONHASHSEED'])"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "5"


@pytest.mark.parametrize("value", STRAY, ids=repr)
def test_the_doctor_names_the_exact_value_of_a_stray_cublas_value(value: str):
    said = doctor_says(CUDA, NCCL_NVLS_ENABLE="0", CUBLAS_WORKSPACE_CONFIG=value)

    assert f"{CUBLAS}={value!r} differs from {value.strip()!r}" in said
    assert f"export {CUBLAS}={value.strip()}" in said
    assert said.count(f"{CUBLAS}=") == 2  # one warning, not two: as written, then the export


def test_the_doctor_names_an_hccl_value_in_another_case():
    said = doctor_says(NPU, HCCL_DETERMINISTIC=" STRICT")

    assert "HCCL_DETERMINISTIC=' STRICT' differs from 'strict'" in said
    assert "export HCCL_DETERMINISTIC=strict" in said


@given(
    switch=st.sampled_from([s for s in env_switches() if s.keep]),
    before=padding,
    after=padding,
    upper=st.booleans(),
    pick=st.integers(min_value=0),
)
def test_block_run_and_doctor_agree_on_every_spelling_of_an_accepted_value(
    switch, before, after, upper, pick
):
    exact = sorted(switch.keep)[pick % len(switch.keep)]
    value = before + (exact.upper() if upper else exact) + after
    saved = os.environ.get(switch.variable)
    os.environ[switch.variable] = value
    try:
        with detctx.deterministic(seed=2):
            inside = os.environ[switch.variable]
        after_block = os.environ[switch.variable]
    finally:
        if saved is None:
            os.environ.pop(switch.variable, None)
        else:
            os.environ[switch.variable] = saved
    exported = determinism_env(2, {switch.variable: value})[switch.variable]
    warned = f"{switch.variable}={value!r} differs from" in doctor_says(
        CUDA + NPU, **{switch.variable: value}
    )

    assert inside == exported == exact
    assert after_block == value
    assert warned == (value != exact)


@pytest.mark.parametrize("value", STRAY, ids=repr)
def test_a_launcher_preparing_the_environment_exports_the_exact_value(value: str):
    os.environ[CUBLAS] = value

    detctx.prepare_environment(seed=1)

    assert os.environ[CUBLAS] == value.strip()
