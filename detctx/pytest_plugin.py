"""pytest plugin: the ``deterministic`` marker, the ``detctx_seeding`` fixture, ``--detctx-seed``.

Registered through the ``pytest11`` entry point, so installing detctx is
enough. A test runs in a ``deterministic`` block when it carries the marker
or when the session runs with ``--detctx-seed N``; the block is entered
before the test's function-scoped fixtures are set up and exited after they
are torn down (higher-scoped fixtures stay outside it, so session-wide setup
is never rolled back by one test's exit).

The plugin is loaded into every pytest run where detctx is installed, so it
imports nothing of torch, NumPy or the library when it starts: the library is
imported by the first test that uses the marker or a fixture, or at start-up
when ``--detctx-seed`` is given. ``pytest -p no:detctx`` disables it.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

# Nothing of torch or NumPy: the seed parser and the derivation import NumPy only inside.
from detctx._basics import node_seed, parse_seed

if TYPE_CHECKING:
    from detctx._blocks import Seeding, deterministic

__all__ = ["node_seed"]

_MARKER = "deterministic"
_PROPERTY = "detctx_seed"
_HYPOTHESIS_SOURCES = pytest.StashKey[set[str]]()


def _seed_argument(text: str) -> int:
    try:
        return parse_seed(text, "--detctx-seed")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("detctx", "reproducible tests (detctx)")
    group.addoption(
        "--detctx-seed",
        dest="detctx_seed",
        metavar="N",
        type=_seed_argument,
        default=None,
        help=(
            "run every test in its own detctx.deterministic block, seeded from N and the "
            "test's node id; rerun with the same N to replay a failure"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(seed=1234, **switches): run the test, with its function-scoped "
        "fixtures, in a detctx.deterministic block with these arguments",
    )
    if config.getoption("detctx_seed") is not None:
        from importlib.util import find_spec

        if find_spec("hypothesis") is not None:
            # Plain @given tests then get torch reseeded per example, as random and NumPy are.
            from detctx.integrations.hypothesis import register, registered

            before = set(registered())
            config.stash[_HYPOTHESIS_SOURCES] = set(register()) - before


def pytest_unconfigure(config: pytest.Config) -> None:
    # What the session registered ends with it: a later session in this process (pytester,
    # pytest.main called twice) must not find torch reseeded per example.
    names = config.stash.get(_HYPOTHESIS_SOURCES, set())
    if names:
        from detctx.integrations.hypothesis import unregister

        unregister(*names)


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("detctx_seed")
    if seed is None:
        return None
    return f"detctx: --detctx-seed {seed} (each test seeded from it and its node id)"


def _block_for(item: pytest.Item) -> deterministic | None:
    """The block ``item`` runs in: its marker's, else ``--detctx-seed``'s, else none.

    A marker without a seed takes the ``--detctx-seed`` seed when the option is given.
    """
    session_seed = item.config.getoption("detctx_seed")
    marker = item.get_closest_marker(_MARKER)
    if marker is None and session_seed is None:
        return None
    from detctx._blocks import deterministic

    if marker is None:
        return deterministic(node_seed(session_seed, item.nodeid))
    args, kwargs = marker.args, dict(marker.kwargs)
    if session_seed is not None and not args and "seed" not in kwargs:
        kwargs["seed"] = node_seed(session_seed, item.nodeid)
    try:
        return deterministic(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    # Failed outside the except clause: raised inside it, pytest would print the
    # ValueError first, under "During handling of the above exception".
    from detctx._switches import switch_names

    pytest.fail(
        f"bad @pytest.mark.{_MARKER}(...) arguments on {item.nodeid}: {problem}. The marker "
        "takes detctx.deterministic's arguments: seed (an int in [0, 2**32 - 1] or None) "
        f"and the switches {', '.join(switch_names())}",
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def _detctx_block(request: pytest.FixtureRequest) -> Iterator[Seeding | None]:
    item = request.node
    block = _block_for(item)
    if block is None:
        yield None
        return
    with block as seeding, _randomly_paused(item.config):
        item.user_properties.append((_PROPERTY, seeding.seed))
        # A @given test: each example also runs in its own entry of the block.
        from detctx.integrations.hypothesis import examples_in

        with examples_in(block, getattr(item, "obj", None)):
            yield seeding


@contextlib.contextmanager
def _randomly_paused(config: pytest.Config) -> Iterator[None]:
    """pytest-randomly's per-test reseeding held off while the test runs in a block.

    pytest-randomly reseeds ``random`` and NumPy from its own seed in
    ``pytest_runtest_call``, after the fixtures (this block among them) are
    set up and just before the test's body: the body would draw from its
    streams, not the block's. Its reseed before the setup still runs, so
    tests outside blocks keep its order-independent seeds.
    """
    option = config.option
    if not getattr(option, "randomly_reset_seed", False):
        yield
        return
    option.randomly_reset_seed = False
    try:
        yield
    finally:
        option.randomly_reset_seed = True


@pytest.fixture
def detctx_seeding(
    request: pytest.FixtureRequest, _detctx_block: Seeding | None
) -> Iterator[Seeding]:
    """The :class:`~detctx.Seeding` the test runs under.

    That of the marker's (or ``--detctx-seed``'s) block; without either, the
    test gets a block of its own with the default seed (1234).
    """
    if _detctx_block is not None:
        yield _detctx_block
        return
    from detctx._blocks import deterministic

    with deterministic() as seeding, _randomly_paused(request.config):
        yield seeding


@pytest.fixture
def detctx_run(request: pytest.FixtureRequest, detctx_seeding: Seeding) -> Seeding:
    """The former name of :func:`detctx_seeding`, deprecated: it warns, at the test that asks
    for it."""
    # The test's own line: the frames above a fixture are pytest's, never the user's.
    code = request.function.__code__
    warnings.warn_explicit(
        "the detctx_run fixture is deprecated and will be removed: use detctx_seeding",
        DeprecationWarning,
        code.co_filename,
        code.co_firstlineno,
        module=request.module.__name__,
    )
    return detctx_seeding


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    # An old-style wrapper: new-style ones (wrapper=True) need pytest >= 8.
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed:
        seeds = [value for name, value in item.user_properties if name == _PROPERTY]
        if seeds:
            report.sections.append(
                ("detctx", f"this test ran under detctx.deterministic(seed={seeds[-1]})")
            )


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    seed = config.getoption("detctx_seed")
    if seed is None:
        return
    terminalreporter.write_line(
        f"detctx: every test was seeded from --detctx-seed {seed} and its node id; "
        f"replay with: pytest --detctx-seed {seed} [NODE_ID ...]"
    )
    for report in terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == _PROPERTY:
                terminalreporter.write_line(f"detctx: {report.nodeid} failed with seed {value}")
