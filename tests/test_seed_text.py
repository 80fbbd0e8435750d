"""One rule for seed text everywhere: ASCII decimal digits, in range, or the same error."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import detctx
from detctx import _cli as cli
from detctx._basics.seeds import MAX_SEED, parse_seed

REJECTED = ["abc", "٣", "1_000", "-1", "+5", "0x2a", "1e3", "4294967296", "", "  ", "5.0"]
REJECTED.append("\uff11\uff12")  # fullwidth digits


@pytest.mark.parametrize("text", REJECTED)
def test_text_that_is_not_ascii_digits_in_range_is_rejected_with_one_message(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_seed(text, "--seed")

    expected = f"--seed={text!r} is not valid: expected an integer in [0, {MAX_SEED}] written"
    assert str(caught.value).startswith(expected)


@given(st.integers(0, MAX_SEED), st.integers(0, 5))
def test_leading_zeros_and_surrounding_spaces_are_allowed(seed: int, zeros: int) -> None:
    assert parse_seed(f" {'0' * zeros}{seed}\t") == seed


def test_a_huge_string_of_zeros_is_read_without_reaching_ints_digit_limit() -> None:
    assert parse_seed("0" * 100_000 + "7") == 7


def test_a_huge_number_is_rejected_and_the_message_stays_short() -> None:
    with pytest.raises(ValueError, match=r"\(100000 characters\)") as caught:
        parse_seed("9" * 100_000)

    assert len(str(caught.value)) < 200


@pytest.mark.parametrize("text", ["٣", "1_000", "abc"])
def test_detctx_seed_in_the_environment_follows_the_rule(monkeypatch, text: str) -> None:
    monkeypatch.setenv("DETCTX_SEED", text)

    with pytest.raises(ValueError, match=r"DETCTX_SEED=.* is not valid"):
        with detctx.deterministic(seed=None):
            pass


@pytest.mark.parametrize("text", ["٣", "1_000"])
def test_detctx_run_seed_follows_the_rule(capsys, text: str) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "--seed", text, "--", "true"])

    assert exited.value.code == 2
    assert f"--seed={text!r} is not valid" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["٣", "1_000", "-1", "4294967296"])
def test_a_rank_variable_is_read_by_the_same_rule(monkeypatch, text: str) -> None:
    monkeypatch.setenv("RANK", text)

    with pytest.raises(ValueError, match=r"\$RANK=.* is not valid.*rank= to seed_worker"):
        detctx.seed_worker(0)


def test_a_rank_variable_with_leading_zeros_is_that_rank(monkeypatch) -> None:
    from detctx._data.loader import current_rank

    monkeypatch.setenv("RANK", "007")

    assert current_rank() == 7


def test_seed_worker_outside_a_dataloader_worker_says_so_and_seeds_nothing(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    torch.manual_seed(1)
    before = detctx.fingerprint()

    with pytest.raises(RuntimeError, match=r"seed_worker\(3\) was called outside a DataLoader"):
        detctx.seed_worker(3)

    assert detctx.fingerprint() == before


def reference_rule(text: str) -> int | None:
    """The rule as the docs state it: ASCII digits, spaces/tabs around, in range."""
    match = re.fullmatch(r"[ \t\r\n]*([0-9]+)[ \t\r\n]*", text, re.ASCII)
    if match is None or int(match.group(1)) > MAX_SEED:
        return None
    return int(match.group(1))


@pytest.mark.slow
@given(st.one_of(st.text(), st.from_regex(r"\A[ \t]*[0-9_\u0660-\u0669+-]{1,12}[ \t]*\Z")))
def test_any_text_is_read_exactly_by_the_documented_rule(text: str) -> None:
    expected = reference_rule(text)
    if expected is None:
        with pytest.raises(ValueError, match="is not valid: expected an integer"):
            parse_seed(text)
    else:
        assert parse_seed(text) == expected
