"""Prove a computation reproduces: run it several times and compare bit for bit."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from detctx._basics import (
    DEFAULT_SEED,
    NotReproducibleError,
    as_integer,
    nested,
    resolve_seed,
    validate_seed,
)
from detctx._blocks import deterministic
from detctx._state import Snapshot

__all__ = ["check_gradients", "check_reproducible", "first_difference"]

T = TypeVar("T")


def check_reproducible(
    fn: Callable[..., T],
    *args: Any,
    runs: int = 2,
    seed: int | None = DEFAULT_SEED,
    check_rng: bool = True,
    locate: bool = False,
    **kwargs: Any,
) -> T:
    """Run ``fn(*args, **kwargs)`` ``runs`` times and prove the results are identical.

    Each run happens in a fresh ``deterministic(seed=seed)`` block (so each
    starts from the same RNG states and flags, and the caller's states are
    restored afterwards). With ``seed=None`` one seed is resolved
    (``$DETCTX_SEED``, else OS entropy) and used for every run.

    Results may be tensors (any dtype or device), NumPy arrays, numbers,
    strings, ``None`` and lists, tuples (namedtuples too), dicts and
    dataclasses of them. They are compared
    bit for bit: NaN equals NaN at the same position, ``-0.0`` and ``0.0``
    differ, and dtypes, shapes and types must match. Tensors and arrays are
    copied right after each run, so a function that returns the same
    (mutated) object each time is still compared run by run.

    With ``check_rng`` (the default) the RNG states left behind by each run
    are compared too: runs that give the same result but consume different
    amounts of randomness would make everything after them diverge.

    Returns the first run's result. Raises
    :class:`~detctx.NotReproducibleError` naming the first differing
    leaf (``result["logits"][3]``), how many of its elements differ and the
    largest absolute difference, or the RNG sources left in different
    states. With ``locate=True``, a failure runs ``fn`` again under
    :func:`detctx.locate_divergence` and the error's message ends with the
    first op where the runs part (op, module path, source line). ``fn``'s own
    keyword arguments named ``runs``, ``seed``, ``check_rng`` or ``locate``
    must be bound with ``functools.partial``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    runs = _check_runs(runs)
    if not isinstance(check_rng, bool):
        raise TypeError(f"check_rng must be True or False, got {check_rng!r}")
    if not isinstance(locate, bool):
        raise TypeError(f"locate must be True or False, got {locate!r}")
    resolved = resolve_seed(None if seed is None else validate_seed(seed))
    if not locate:
        return _check(fn, args, kwargs, runs, resolved, check_rng=check_rng)
    try:
        return _check(fn, args, kwargs, runs, resolved, check_rng=check_rng)
    except NotReproducibleError as exc:
        from detctx._locate import locate_divergence

        found = locate_divergence(fn, *args, runs=runs, seed=resolved, **kwargs)
        located = (
            "no op differed when the runs were recorded again: the difference comes from "
            "outside torch ops (Python or NumPy values) or did not recur"
        )
        exc.args = (f"{exc.args[0]}\n{located if found is None else found}", *exc.args[1:])
        raise


def _check(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    runs: int,
    seed: int,
    *,
    check_rng: bool,
) -> T:
    block = deterministic(seed)

    first: T | None = None
    reference: Any = None
    reference_rng: dict[str, str] = {}
    for index in range(runs):
        with block:
            result = fn(*args, **kwargs)
            frozen = _freeze(result)
            rng = Snapshot.capture().source_fingerprints()
        if index == 0:
            first, reference, reference_rng = result, frozen, rng
            continue
        _raise_if_different(reference, frozen, index + 1, block.seed)
        if check_rng and rng != reference_rng:
            changed = tuple(name for name in reference_rng if reference_rng[name] != rng.get(name))
            raise NotReproducibleError(
                f"run {index + 1} returned the same result as run 1 but left the RNG(s) "
                f"{', '.join(changed)} in a different state (seed={block.seed}): the runs "
                "consumed different amounts of randomness, so whatever runs after them will "
                "diverge. Look for a draw that depends on outside state (a counter, a cache, "
                "time); pass check_rng=False to compare results only",
                run=index + 1,
                sources=changed,
            )
    return first  # type: ignore[return-value]


def check_gradients(
    model: torch.nn.Module,
    *inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    runs: int = 2,
    seed: int | None = DEFAULT_SEED,
    check_rng: bool = True,
) -> dict[str, Any]:
    """Prove a forward and backward pass of ``model`` reproduces, gradients included.

    The arguments after ``model`` are the model's own positional arguments,
    passed as they are: ``check_gradients(model, x)`` runs ``model(x)``,
    ``check_gradients(model, x, mask)`` runs ``model(x, mask)``; a tuple of
    inputs is unpacked by the caller, ``check_gradients(model, *inputs)``::

        grads = detctx.check_gradients(model, x, loss_fn=lambda out: out.pow(2).mean())

    Each run, in a fresh ``deterministic(seed=seed)`` block, computes
    ``output = model(*inputs)`` and ``loss = loss_fn(output)`` (default: the
    sum of the output), calls ``loss.backward()`` with every gradient
    cleared first, and collects ``{"output", "loss", "grads"}``, where
    ``grads`` maps each parameter's name to its gradient (``None`` when it got
    none). These are compared as :func:`check_reproducible` compares, so a
    mismatch names e.g. ``result["grads"]["fc.weight"]``.

    The model's parameters, buffers (running statistics, say) and ``.grad``
    attributes are put back after the runs, so the model is left as it was.
    Returns the first run's ``{"output", "loss", "grads"}``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    _check_runs(runs)
    named = list(model.named_parameters())
    saved_state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    saved_grads = [param.grad for _, param in named]

    def forward_backward() -> dict[str, Any]:
        model.load_state_dict(saved_state)
        for _, param in named:
            param.grad = None
        try:
            output = model(*inputs)
        except TypeError as exc:
            if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
                kind = type(inputs[0]).__name__
                raise TypeError(
                    f"check_gradients called model({kind} of {len(inputs[0])}) and the model "
                    f"refused it: {exc}. check_gradients passes the arguments after the model "
                    f"to it as they are; to pass a {kind} of inputs as separate arguments, "
                    f"unpack it: check_gradients(model, *inputs)"
                ) from exc
            raise
        loss = output.sum() if loss_fn is None else loss_fn(output)
        loss.backward()
        grads = {
            name: None if param.grad is None else param.grad.detach().clone()
            for name, param in named
        }
        return {"output": _detach(output), "loss": loss.detach(), "grads": grads}

    try:
        return check_reproducible(forward_backward, runs=runs, seed=seed, check_rng=check_rng)
    finally:
        model.load_state_dict(saved_state)
        for (_, param), grad in zip(named, saved_grads):
            param.grad = grad


@dataclass(frozen=True)
class Difference:
    """The first place where two results differ."""

    path: str
    reason: str
    mismatched: int = 0
    total: int = 0
    max_abs_diff: float | None = None


def first_difference(a: Any, b: Any, path: str = "result") -> Difference | None:
    """The first leaf (depth first, in order) where ``a`` and ``b`` differ, or ``None``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _compare_arrays(a, b, path, torch.Tensor)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _compare_arrays(a, b, path, np.ndarray)
    if type(a) is not type(b):
        return Difference(path, f"types differ: {type(a).__name__} vs {type(b).__name__}")
    found_a, found_b = nested.branches(a), nested.branches(b)
    if found_a is not None and found_b is not None:
        return _first_difference_inside(found_a, found_b, path)
    if isinstance(a, (float, complex, np.floating, np.complexfloating)):
        return _compare_arrays(np.asarray(a), np.asarray(b), path, np.ndarray)
    if isinstance(a, (bool, int, str, bytes, np.integer, np.bool_)) or a is None:
        if a == b:
            return None
        return Difference(path, f"{a!r} vs {b!r}", 1, 1, _number_diff(a, b))
    raise TypeError(
        f"cannot compare {path} of type {type(a).__name__}: return tensors, arrays, numbers, "
        "strings or lists, tuples and dicts of them"
    )


def _first_difference_inside(
    found_a: tuple[nested.Kind, list[tuple[Any, Any]]],
    found_b: tuple[nested.Kind, list[tuple[Any, Any]]],
    path: str,
) -> Difference | None:
    """The first difference inside two containers of one type."""
    kind, items_a = found_a
    items_b = found_b[1]
    if kind is nested.Kind.MAPPING:
        keys_a, keys_b = [key for key, _ in items_a], [key for key, _ in items_b]
        if keys_a != keys_b:
            only_a = [k for k in keys_a if k not in keys_b]
            only_b = [k for k in keys_b if k not in keys_a]
            detail = f"only in run 1: {only_a}, only in the other: {only_b}"
            if not only_a and not only_b:
                detail = "same keys in a different order"
            return Difference(path, f"keys differ ({detail})")
    elif len(items_a) != len(items_b):
        return Difference(path, f"lengths differ: {len(items_a)} vs {len(items_b)}")
    for index, ((key, item_a), (_, item_b)) in enumerate(zip(items_a, items_b)):
        where = nested.child_path(path, kind, key, index, _render_key)
        found = first_difference(item_a, item_b, where)
        if found is not None:
            return found
    return None


def _check_runs(runs: object) -> int:
    count = as_integer(runs)
    if count is None:
        raise TypeError(f"runs must be an integer, got {runs!r}")
    if count < 2:
        raise ValueError(f"runs must be at least 2 to compare anything, got {runs}")
    return count


def _render_key(key: object) -> str:
    return json.dumps(key) if isinstance(key, str) else repr(key)


def _detach(value: Any) -> Any:
    return nested.map_leaves(
        lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, value
    )


def _freeze(value: Any) -> Any:
    """A copy of ``value`` that later runs cannot change: tensors and arrays cloned."""
    return nested.map_leaves(_frozen_leaf, value)


def _frozen_leaf(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().clone()
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    return leaf


def _raise_if_different(reference: Any, result: Any, run: int, seed: int | None) -> None:
    found = first_difference(reference, result)
    if found is None:
        return
    message = f"run {run} differs from run 1 (seed={seed}) at {found.path}: {found.reason}"
    raise NotReproducibleError(
        message,
        path=found.path,
        run=run,
        mismatched=found.mismatched,
        total=found.total,
        max_abs_diff=found.max_abs_diff,
    )


def _compare_arrays(a: Any, b: Any, path: str, kind: type) -> Difference | None:
    same_kind = isinstance(a, kind) and isinstance(b, kind)
    if not same_kind:
        return Difference(path, f"types differ: {type(a).__name__} vs {type(b).__name__}")
    if a.dtype != b.dtype:
        return Difference(path, f"dtypes differ: {a.dtype} vs {b.dtype}")
    if tuple(a.shape) != tuple(b.shape):
        return Difference(path, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if isinstance(a, torch.Tensor):
        bits_a, nan_a, values_a = _tensor_parts(a)
        bits_b, nan_b, values_b = _tensor_parts(b)
    elif a.dtype.kind in "fciub":
        bits_a, nan_a, values_a = _array_parts(a)
        bits_b, nan_b, values_b = _array_parts(b)
    else:
        # Strings, objects, datetimes: no bit view to rely on; compare element by element.
        pairs = zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())
        bits_a = np.array([[x == y] for x, y in pairs], dtype=bool).reshape(-1, 1)
        bits_b, nan_a, nan_b = np.ones_like(bits_a), np.zeros(a.size, bool), np.zeros(b.size, bool)
        values_a = values_b = None
    differs = (bits_a != bits_b).any(axis=1) & ~(nan_a & nan_b)
    mismatched = int(differs.sum())
    if mismatched == 0:
        return None
    total = int(differs.size)
    first = int(np.flatnonzero(differs)[0])
    max_diff: float | None = None
    if values_a is not None and values_b is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            gaps = np.abs(values_a[differs] - values_b[differs])
        max_diff = math.nan if np.isnan(gaps).any() else float(gaps.max())
    where = ""
    if a.ndim:
        where = f", first at index {tuple(int(i) for i in np.unravel_index(first, a.shape))}"
    diff_text = "" if max_diff is None else f", max abs difference {max_diff:.6g}"
    if max_diff == 0.0:
        diff_text += " (signs of zero differ)"
    reason = f"{mismatched} of {total} elements differ{where}{diff_text}"
    return Difference(path, reason, mismatched, total, max_diff)


def _tensor_parts(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    t = t.detach().cpu().contiguous().reshape(-1)
    size = t.element_size()
    bits = t.view(torch.uint8).reshape(-1, size).numpy() if t.numel() else np.zeros((0, size))
    if t.is_floating_point() or t.is_complex():
        nan = torch.isnan(t).numpy()
        return bits, nan, (t.to(torch.complex128) if t.is_complex() else t.double()).numpy()
    nan = np.zeros(t.numel(), dtype=bool)
    return bits, nan, None if t.dtype == torch.bool else t.double().numpy()


def _array_parts(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    flat = np.ascontiguousarray(a).reshape(-1)
    bits = flat.view(np.uint8).reshape(-1, flat.dtype.itemsize)
    if flat.dtype.kind in "fc":
        return bits, np.isnan(flat), flat.astype(np.complex128 if flat.dtype.kind == "c" else float)
    nan = np.zeros(flat.size, dtype=bool)
    return bits, nan, None if flat.dtype.kind == "b" else flat.astype(float)


def _number_diff(a: object, b: object) -> float | None:
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return float(abs(int(a) - int(b)))
    return None
