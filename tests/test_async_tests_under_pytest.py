"""An ``async def`` test under pytest: pytest runs one only through an async plugin (here
anyio's, ``@pytest.mark.anyio``); ``@pytest.mark.deterministic`` then holds it in a block."""

from __future__ import annotations

import random

import pytest

anyio = pytest.importorskip("anyio")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.deterministic(seed=0)
async def test_an_async_test_marked_for_anyio_draws_what_its_seed_gives() -> None:
    await anyio.sleep(0)
    drawn = random.random()

    random.seed(0)
    assert drawn == random.random()
