"""A crafted difference: what the digest's secret key stops, and how the key is handed on.

The digest's first step is linear in the tensor's bytes. Under fixed, public
weights a short vector of that step's kernel (lattice reduction, seconds)
gives two different tensors one digest, and locate would call two runs that
differ identical. Under the process's secret key it is a difference like
any other.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from sympy import ZZ
from sympy.polys.matrices import DomainMatrix

import detctx
import detctx._locate.keys as keys_module
from detctx._basics import TraceError
from detctx._locate.digest import SMALL, digest, whole_rows_digest
from detctx._locate.keys import KEY_ENV, PUBLIC_KEY, DigestKey, process_key, use_key
from detctx._locate.staging import Staging

POSITIONS = 20


def kernel_difference(weights: torch.Tensor) -> np.ndarray:
    """Small integers ``d`` with ``weights[:POSITIONS].T @ d == 0``: a difference in the
    first bytes of a row that the reduce step cannot see (LLL on a scaled basis)."""
    matrix = weights.numpy().astype(int)
    columns = matrix.shape[1]
    basis = [
        [int(i == j) for j in range(POSITIONS)] + [int(matrix[i, c]) << 20 for c in range(columns)]
        for i in range(POSITIONS)
    ]
    for vector in (
        DomainMatrix(basis, (POSITIONS, POSITIONS + columns), ZZ).lll().to_Matrix().tolist()
    ):
        head = np.array(vector[:POSITIONS], dtype=np.int64)
        if not any(vector[POSITIONS:]) and head.any() and np.abs(head).max() <= 127:
            assert not (matrix[:POSITIONS].T @ head).any()
            return head.astype(np.int8)
    raise AssertionError("no short kernel vector found")


@pytest.fixture(scope="module")
def crafted() -> tuple[torch.Tensor, torch.Tensor]:
    """Two different int32 tensors of 4 KiB (reduced once) whose public digests agree."""
    plain = torch.zeros(1024, dtype=torch.int32)
    changed = plain.clone()
    difference = kernel_difference(PUBLIC_KEY.weights(0, torch.device("cpu")))
    changed.numpy().view(np.int8)[:POSITIONS] = difference
    assert plain.nbytes > SMALL and not torch.equal(plain, changed)
    return plain, changed


def test_a_difference_crafted_against_the_public_weights_passes_them_and_no_secret_key(
    crafted: tuple[torch.Tensor, torch.Tensor],
):
    plain, changed = crafted

    assert digest(plain, key=PUBLIC_KEY) == digest(changed, key=PUBLIC_KEY)
    assert digest(plain) != digest(changed)
    assert whole_rows_digest(plain.repeat(2)) != whole_rows_digest(changed.repeat(2))
    staging = Staging()
    staging.add(plain)
    staging.add(changed)
    high, low = staging.digests()
    assert (high[0], low[0]) != (high[1], low[1])
    assert (int(high[0]) << 64) | int(low[0]) == digest(plain)


def test_locate_finds_a_difference_crafted_against_the_public_digest(
    crafted: tuple[torch.Tensor, torch.Tensor],
):
    plain, changed = crafted
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        data = (changed if len(calls) % 2 == 0 else plain).clone()
        data.add(0)  # the first recorded op: its output is the crafted bytes

    found = detctx.locate_divergence(step, seed=3)

    assert found is not None and found.op == "aten::add.Tensor"
    assert found.reason == "values"


def test_each_key_draws_its_own_constants_and_the_public_key_the_published_ones():
    first, second = DigestKey(bytes(16)), DigestKey(bytes(15) + b"\x01")
    cpu = torch.device("cpu")

    assert not torch.equal(first.weights(0, cpu), second.weights(0, cpu))
    assert not torch.equal(first.weights(0, cpu), first.weights(1, cpu))
    assert not np.array_equal(first.stream(0), first.stream(1))
    assert all(int(w) % 2 for w in first.weights(0, cpu).reshape(-1)[:4096].tolist())
    assert (first.stream(0) & np.uint64(1)).all()
    # The public constants are the splitmix64 streams digests used before keys.
    assert int(PUBLIC_KEY.stream(0)[0]) == 0xE220A8397B1DCDAF  # splitmix64(0), first


def test_making_the_process_key_moves_no_random_stream(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(keys_module, "_process_key", None)
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    key = process_key()

    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert key is process_key()
    assert before[0] == after[0]
    assert all(np.array_equal(a, b) for a, b in zip(before[1][1:], after[1][1:]))
    assert torch.equal(before[2], after[2])


@pytest.mark.parametrize(
    "text",
    [
        "",
        "00" * 15,
        "00" * 17,
        "AB" * 16,
        "zz" * 16,
        "00" * 16 + "\n",
        " " + "00" * 16,
        "0x" + "0" * 30,
    ],
)
def test_a_key_that_is_not_32_lowercase_hex_digits_is_refused_and_nothing_changes(
    text: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(keys_module, "_process_key", None)
    known = process_key()

    with pytest.raises(TraceError, match=KEY_ENV):
        use_key(text)

    assert process_key() is known


def test_a_key_handed_on_after_digests_were_made_with_another_is_refused(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(keys_module, "_process_key", None)
    use_key("ab" * 16)
    assert use_key("ab" * 16).hex() == "ab" * 16  # the same key again is fine

    with pytest.raises(TraceError, match="before recording starts"):
        use_key("cd" * 16)
    assert process_key().hex() == "ab" * 16


@pytest.mark.slow
def test_a_run_handed_a_malformed_key_records_nothing_and_its_program_never_sees_it(tmp_path):
    trace = tmp_path / "run1.trace"
    script = (
        "import os, detctx._locate.child as child\n"
        "print(child.start_from_environment())\n"
        f"print(os.environ.get({KEY_ENV!r}))\n"
    )
    env = dict(os.environ, DETCTX_LOCATE_TRACE=str(trace), **{KEY_ENV: "not a key"})

    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )

    assert done.stdout.split() == ["False", "None"]
    assert KEY_ENV in done.stderr and not trace.exists()


def test_a_buffer_kept_under_another_key_is_not_lent_again(monkeypatch: pytest.MonkeyPatch):
    from detctx._locate.staging import borrow, give_back

    give_back(borrow())
    monkeypatch.setattr(keys_module, "_process_key", DigestKey(bytes(16)))

    staging = borrow()

    assert staging.key is process_key()
    staging.add(torch.ones(4096))
    high, low = staging.digests()
    assert (int(high[0]) << 64) | int(low[0]) == digest(torch.ones(4096))
