"""Hammer every loader of saved state with values of the wrong type; print how each ended.

    python benchmarks/hammer_state_types.py [-v]

The states: an RNG state dict (``detctx.capture().state_dict()``), an
elastic loader's and a resumable loader's (each after one batch of a
shuffled 40-item loader; the resumable one where torchdata is installed),
``detctx.resume_state`` of each loader, and a Lightning
``DeterministicCallback``'s (where Lightning is installed). Every
value at every depth (the whole state included) is replaced in turn by each
stand-in: a 1-D float tensor, a 2x2 int64 tensor, a 0-d tensor, a string, a
list, ``None``, ``2**70``, ``-1``, ``1.5``, ``True`` and an empty dict; then
the state is loaded where it came from, warnings recorded. Outcomes:

- ``refused``: ``CheckpointError``, no warning, and every RNG and the loader
  as before;
- ``same``: accepted, where the stand-in equals the saved value (``True`` for
  a loader saved with ``shuffle=True``, ``None`` for Python's cached Gaussian
  when none is cached), with nothing changed;
- ``accepted``, ``other_error``, ``warned``, ``refused_changed``: failures,
  each printed; the exit status is 1 if there is any.

The figures are those quoted in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import detctx
from detctx import CheckpointError, MissingDependencyError

FAILURES = ("accepted", "other_error", "warned", "refused_changed")


def stand_ins() -> list[Any]:
    return [
        torch.zeros(3),
        torch.zeros(2, 2, dtype=torch.int64),
        torch.tensor(2),
        "key",
        [1, 2],
        None,
        2**70,
        -1,
        1.5,
        True,
        {},
    ]


def places(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in ``value``, itself first: keys of dicts, indices of lists."""
    yield path
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from places(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from places(item, (*path, index))


def put(state: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``state`` with ``value`` at ``path``."""
    if not path:
        return value
    crafted = copy.deepcopy(state)
    target = crafted
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return crafted


def at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def equal(a: Any, b: Any) -> bool:
    """Whether a stand-in is the saved value itself (a tensor only equals a tensor)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


def hammer(
    name: str, state: Any, load: Callable[[Any], None], looks: Callable[[], Any], verbose: bool
) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    for path in places(state):
        for stand_in in stand_ins():
            crafted = put(state, path, stand_in)
            before = looks()
            error: BaseException | None = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    load(crafted)
                except Exception as exc:  # every error is an outcome
                    error = exc
            changed = looks() != before
            if caught:
                outcome = "warned"
            elif isinstance(error, CheckpointError):
                outcome = "refused_changed" if changed else "refused"
            elif error is not None:
                outcome = "other_error"
            elif path and equal(at(state, path), stand_in) and not changed:
                outcome = "same"
            else:
                outcome = "accepted"
            outcomes[outcome] += 1
            if outcome in FAILURES or verbose:
                told = f"{type(error).__name__}: {error}" if error is not None else ""
                shown = " ".join(repr(stand_in).split())[:40]
                print(f"  {name} {list(path)} <- {shown}: {outcome} {told}"[:300])
                for warning in caught:
                    print(f"    warning: {warning.message}"[:300])
    return outcomes


def _rng_state() -> Any:
    return detctx.capture().state_dict()


def _loader_looks(loader: Any) -> Any:
    return detctx.fingerprint(), repr(loader.state_dict())


def _callback_looks(callback: Any) -> Any:
    # A state taken before the run starts waits for setup: the digest of the one waiting.
    pending = callback._pending
    return detctx.fingerprint(), None if pending is None else repr(pending.state_dict()["digest"])


def _resume(state: Any, *, loaders: tuple[Any, ...]) -> None:
    detctx.resume(state, *loaders)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="print every outcome")
    args = parser.parse_args(argv)
    items = list(range(40))
    # Each case: its name, what saves its state (called just before it is hammered, so an
    # accepted state that equals the saved one changes nothing), what loads it, and what
    # must look the same after a refusal.
    cases: list[tuple[str, Callable[[], Any], Callable[[Any], None], Callable[[], Any]]] = [
        ("rng", _rng_state, detctx.restore, detctx.fingerprint)
    ]
    loaders = [("elastic", detctx.elastic_loader(items, batch_size=4, seed=3))]
    try:
        resumable = detctx.resumable_loader(items, batch_size=4, shuffle=True, seed=5)
    except MissingDependencyError as exc:  # torchdata is the resume extra's
        print(f"resumable: not tried ({exc})")
    else:
        loaders.append(("resumable", resumable))
    for name, loader in loaders:
        next(iter(loader))
        looks = functools.partial(_loader_looks, loader)
        cases.append((name, loader.state_dict, loader.load_state_dict, looks))
        resume = functools.partial(_resume, loaders=(loader,))
        saved = functools.partial(detctx.resume_state, loader)
        cases.append((f"resume({name})", saved, resume, looks))
    try:
        from detctx.integrations.lightning import DeterministicCallback

        callback = DeterministicCallback(seed=3)
    except (ImportError, MissingDependencyError) as exc:  # Lightning is the test extra's
        print(f"lightning: not tried ({exc})")
    else:
        callback.load_state_dict(callback.state_dict())  # what waits, before and after
        looks = functools.partial(_callback_looks, callback)
        cases.append(("lightning", callback.state_dict, callback.load_state_dict, looks))
    failed = False
    for name, save, load, looks in cases:
        outcomes = hammer(name, save(), load, looks, args.verbose)
        failed = failed or any(outcomes[failure] for failure in FAILURES)
        counts = ", ".join(f"{outcome} {count}" for outcome, count in sorted(outcomes.items()))
        print(f"{name}: {sum(outcomes.values())} crafted states: {counts}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
