"""Property: any program of draws, nested blocks and exceptions behaves as if each block
ran in its own seeded world and the surrounding code never saw it."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Union

import numpy as np
import pytest
import torch
from helpers import mindspeed_seed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import detctx

KINDS = ("python", "numpy", "torch", "numpy_normal", "torch_normal", "python_gauss")


def draw(kind: str) -> float:
    if kind == "python":
        return random.random()
    if kind == "python_gauss":  # random.gauss keeps a cached second value in its state
        return random.gauss(0, 1)
    if kind == "numpy":
        return float(np.random.rand())
    if kind == "numpy_normal":  # the legacy gauss cache is part of NumPy's state
        return float(np.random.randn())
    if kind == "torch":
        return float(torch.rand(1))
    return float(torch.randn(1))


class Boom(BaseException):
    """Leaves a block the way KeyboardInterrupt would: not an Exception."""


@dataclass(frozen=True)
class Block:
    seed: int
    body: tuple[str | Block, ...]
    raises: type[BaseException] | None


Program = tuple[Union[str, Block], ...]

seeds = st.sampled_from([0, 1, 7, 1234, 2**32 - 1])
programs: st.SearchStrategy[Program] = st.recursive(
    st.lists(st.sampled_from(KINDS), max_size=4).map(tuple),
    lambda children: st.lists(
        st.one_of(
            st.sampled_from(KINDS),
            st.builds(
                Block,
                seed=seeds,
                body=children,
                raises=st.sampled_from([None, ValueError, Boom]),
            ),
        ),
        max_size=4,
    ).map(tuple),
    max_leaves=12,
)


def execute(
    program: Program, blocks: dict[int, detctx.deterministic], trace: list, scope: tuple = ()
) -> None:
    """Run ``program``; record each draw under its scope's path (block indices)."""
    for index, step in enumerate(program):
        if isinstance(step, str):
            trace.append((scope, draw(step)))
            continue
        block = blocks.setdefault(step.seed, detctx.deterministic(seed=step.seed))
        try:
            with block:
                execute(step.body, blocks, trace, (*scope, index))
                if step.raises is not None:
                    raise step.raises("leaving the block")
        except (ValueError, Boom):
            pass


def expected(program: Program, seed: int, out: list, scope: tuple = ()) -> None:
    """What each scope must draw: its own direct draws from a fresh seeded world."""
    mindspeed_seed(seed)
    out.extend((scope, draw(step)) for step in program if isinstance(step, str))
    for index, step in enumerate(program):
        if isinstance(step, Block):
            expected(step.body, step.seed, out, (*scope, index))


def flags_and_env() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "HCCL_DETERMINISTIC")},
    )


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs, start=seeds)
def test_any_program_of_blocks_matches_the_reference(program: Program, start: int) -> None:
    torch.backends.cudnn.benchmark = True
    flags_before = flags_and_env()

    reference: list = []
    expected(program, start, reference)
    # Outer code continues as if no block ran: its final state is the reference's after its
    # own draws only.
    mindspeed_seed(start)
    for step in program:
        if isinstance(step, str):
            draw(step)
    final_reference = detctx.fingerprint()

    mindspeed_seed(start)
    trace: list = []
    execute(program, {}, trace)

    assert len(trace) == len(reference)
    for scope in {scope for scope, _ in reference}:
        assert [v for s, v in trace if s == scope] == [v for s, v in reference if s == scope]
    assert detctx.fingerprint() == final_reference
    assert flags_and_env() == flags_before
