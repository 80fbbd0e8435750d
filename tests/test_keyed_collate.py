"""Keyed collation: the key of a batch is the same in every process, or the batch is refused.

A keyed collator draws from a world seeded by the batch's contents, so two
processes that collate the same batch (a resumed run, another worker) must
read the same key from it, whatever their hash seed or memory layout.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ROOT, TESTS

import detctx
from detctx._data.keyed_collate import KeyedCollate, content_digest


def draw(features: Any) -> list[float]:
    """A collator whose output is nothing but its random draws."""
    return [random.random(), float(torch.rand(()))]


def keyed() -> KeyedCollate:
    return KeyedCollate(draw, seed=7)


def digest_in_fresh_process(code: str, hash_seed: str) -> str:
    """``content_digest(features)`` in a new interpreter with ``PYTHONHASHSEED=hash_seed``."""
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    script = (
        "import numpy as np\n"
        "from detctx._data.keyed_collate import content_digest\n"
        + textwrap.dedent(code)
        + "\nprint(content_digest(features).hex())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    "features",
    [
        "features = [{'tags': set('abcdefghijklmnop'), 'ids': [1, 2]}]",
        "features = [{'words': np.array(['the', 'cat', ('a', 1)], dtype=object)}]",
        "features = [{'sets': frozenset({'x', 'yy', 'zzz', 'wwww', 'vvvvv'})}]",
    ],
    ids=["a set of strings", "a NumPy object array", "a frozenset"],
)
def test_a_batch_keys_alike_in_two_fresh_processes_with_different_hash_seeds(
    features: str,
) -> None:
    digests = {digest_in_fresh_process(features, seed) for seed in ("1", "2", "3")}

    assert len(digests) == 1, digests


def test_object_arrays_of_equal_elements_key_alike_wherever_the_elements_live() -> None:
    words = ["the", "cat"]
    copies = ["".join(word) for word in (["t", "h", "e"], ["c", "a", "t"])]

    one = np.array(words, dtype=object)
    other = np.array(copies, dtype=object)

    assert content_digest(one) == content_digest(other)
    assert content_digest(one) != content_digest(np.array(["the", "dog"], dtype=object))


def test_views_key_as_the_values_they_show() -> None:
    values = torch.tensor([1 + 2j, 3 - 1j])
    real = torch.tensor([1.0, -2.0])

    assert content_digest(values.conj()) == content_digest(values.conj().resolve_conj())
    assert content_digest(values.conj()) != content_digest(values)
    assert content_digest(real._neg_view()) == content_digest(-real)
    assert content_digest(real._neg_view()) != content_digest(real)


def test_sparse_tensors_key_by_their_values_in_any_order_of_entries() -> None:
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    shuffled = torch.sparse_coo_tensor([[1, 0], [0, 1]], [2.0, 1.0], (2, 2))

    assert content_digest(dense.to_sparse()) == content_digest(shuffled)
    assert content_digest(dense.to_sparse()) != content_digest((dense * 2).to_sparse())
    assert content_digest(dense.to_sparse_csr()) != content_digest(
        (dense * 2).to_sparse_csr()
    )


def test_nested_tensors_key_by_their_components() -> None:
    parts = [torch.ones(2), torch.arange(3.0)]

    nested = torch.nested.nested_tensor(parts)

    assert content_digest(nested) == content_digest(torch.nested.nested_tensor(parts))
    assert content_digest(nested) != content_digest(
        torch.nested.nested_tensor([torch.ones(2), torch.arange(1.0, 4.0)])
    )


def test_a_keyed_collator_collates_each_kind_of_tensor_and_leaves_the_streams_alone() -> None:
    collate = keyed()
    batches = {
        "sparse": [torch.eye(3).to_sparse()],
        "conjugate": [torch.tensor([1j]).conj()],
        "negative": [torch.ones(2)._neg_view()],
        "nested": [torch.nested.nested_tensor([torch.ones(1), torch.ones(2)])],
    }
    random.seed(0)
    before = detctx.fingerprint()

    for batch in batches.values():
        assert collate(batch) == collate(batch)

    assert detctx.fingerprint() == before


@pytest.mark.parametrize(
    "batch, named",
    [
        ([torch.ones(2, device="meta")], "meta tensor"),
        ([{"x": np.array([(1, {"a"})], dtype=[("n", "i4"), ("o", "O")])}], "structured array"),
        ([{"transform": lambda x: x}], "cannot be pickled"),
    ],
    ids=["a meta tensor", "a structured array of objects", "a lambda"],
)
def test_a_batch_that_cannot_key_alike_everywhere_is_refused_before_any_rng_moves(
    batch: Any, named: str
) -> None:
    random.seed(0)
    before = detctx.fingerprint()

    with pytest.raises(TypeError, match=named):
        keyed()(batch)

    assert detctx.fingerprint() == before


class Tags:
    """A feature object whose attribute is a set (its pickle follows PYTHONHASHSEED)."""

    def __init__(self) -> None:
        self.names = {"a", "b", "c"}


def test_an_object_holding_a_set_is_refused_naming_the_hash_seed() -> None:
    with pytest.raises(TypeError, match="PYTHONHASHSEED"):
        keyed()([{"tags": Tags()}])


def test_one_keyed_world_entered_again_inside_itself_puts_back_each_level() -> None:
    from detctx._data.keyed_collate import KeyedStreams
    from detctx._sources import registered_sources

    world = KeyedStreams([(n, s) for n, s in registered_sources() if n in ("torch", "python")])
    torch.manual_seed(1)
    random.seed(1)
    outside = detctx.fingerprint()
    with world as reseed:
        reseed(5)
        first = (torch.rand(1), random.random())
        inside = detctx.fingerprint()
        with world as reseed_again:
            reseed_again(5)
            again = (torch.rand(1), random.random())
            assert torch.equal(again[0], first[0]) and again[1] == first[1]
        assert detctx.fingerprint() == inside
        with pytest.raises(ValueError):
            with world:
                torch.rand(7)
                raise ValueError("inside the inner world")
        assert detctx.fingerprint() == inside
    assert detctx.fingerprint() == outside
    assert detctx.open_blocks() == ()
