"""hypothesis: torch reseeded per example, and ``@given`` tests inside detctx blocks.

hypothesis seeds ``random`` and NumPy's global generator before every example
and restores them after; torch's generators are not among them, so a test
drawing from torch sees a different stream in every example, and a failing
example may pass when hypothesis replays it (``FlakyFailure``) instead of
shrinking. Two ways to fix that:

- :func:`register`: hypothesis then seeds torch's CPU generator and every
  accelerator already initialised as it seeds ``random`` (``seed(0)`` before
  each example, the previous state back after). The pytest plugin calls it
  under ``--detctx-seed``::

      from detctx.integrations.hypothesis import register

      register()          # once, e.g. in conftest.py

- ``@detctx.deterministic(seed=s)`` above ``@given`` (or
  ``@pytest.mark.deterministic(seed=s)`` on it): every example runs in its own
  entry of the block, so it starts from ``s`` for every source, torch
  included, with determinism switched on, and everything is put back after
  it (:func:`examples_in` does this for the plugin).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from detctx._basics import MissingDependencyError
from detctx._blocks import Block, decorate, is_hypothesis_test
from detctx._sources import AcceleratorSource, RNGSource
from detctx._state import active_sources

__all__ = ["examples_in", "register", "registered", "unregister"]


class SourceRandom:
    """One detctx RNG source seen as hypothesis sees a ``random.Random``:
    ``seed``, ``getstate`` and ``setstate``."""

    __slots__ = ("__weakref__", "name", "source")

    def __init__(self, name: str, source: RNGSource) -> None:
        self.name = name
        self.source = source

    def seed(self, seed: int) -> None:
        self.source.seed(seed)

    def getstate(self) -> Any:
        return self.source.capture()

    def setstate(self, state: Any) -> None:
        self.source.restore(state)

    def __repr__(self) -> str:
        return f"SourceRandom({self.name!r})"


# hypothesis holds registered randoms weakly: these references keep them managed.
_registered: dict[str, SourceRandom] = {}


def register() -> tuple[str, ...]:
    """Have hypothesis seed and restore torch's RNGs around every example.

    Registers torch's CPU generator and each accelerator that is initialised
    now with ``hypothesis.register_random``. Calling it again registers
    accelerators initialised since; nothing is registered twice. Returns the
    names of every source registered so far (``("torch",)`` on a CPU
    machine). Raises :class:`~detctx.MissingDependencyError` without
    hypothesis.
    """
    try:
        hypothesis = importlib.import_module("hypothesis")
    except ImportError as exc:
        raise MissingDependencyError(
            f"detctx.integrations.hypothesis needs hypothesis ({exc}): "
            "pip install 'detctx[hypothesis]'"
        ) from exc
    for name, source in active_sources():
        if name in _registered:
            continue
        if name == "torch" or (isinstance(source, AcceleratorSource) and source.is_initialized()):
            managed = SourceRandom(name, source)
            _registered[name] = managed
            hypothesis.register_random(managed)
    return tuple(_registered)


def registered() -> tuple[str, ...]:
    """The names of the sources :func:`register` has given hypothesis so far."""
    return tuple(_registered)


def unregister(*names: str) -> None:
    """Stop hypothesis managing the named sources (every registered one without names).

    hypothesis holds them weakly, so dropping detctx's reference ends their
    management; names not registered are ignored.
    """
    for name in names or tuple(_registered):
        _registered.pop(name, None)


@contextmanager
def examples_in(block: Block, test: Any) -> Iterator[None]:
    """While it is open, every example of the ``@given`` test ``test`` runs in its own
    entry of ``block``; afterwards the test is as it was. Anything else is left alone.

    The pytest plugin uses it for tests that carry the ``deterministic``
    marker or run under ``--detctx-seed``.
    """
    if not is_hypothesis_test(test):
        yield
        return
    handle = test.hypothesis
    inner = handle.inner_test
    handle.inner_test = decorate(block, inner)
    try:
        yield
    finally:
        handle.inner_test = inner
