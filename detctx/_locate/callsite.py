"""The user's source line that issued an op: the first frame outside torch, detctx and
the standard library.

Walking the stack costs a few frames per op (a module's ``forward`` sits
under torch's ``_call_impl``); whether a code object is internal is decided
once per code object and cached.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import CodeType, FrameType

import torch

__all__ = ["UNKNOWN", "defined_at", "keep_for_backward", "user_line", "user_line_in_backward"]

UNKNOWN = "<unknown>"
_INTERNAL = (
    os.path.dirname(os.path.abspath(torch.__file__ or "")) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_INSTALLED = tuple(
    {os.path.join(sysconfig.get_paths()[name], "") for name in ("purelib", "platlib")}
)
_ENGINE = tuple(
    os.path.join(_INTERNAL[0], "autograd", name) for name in ("__init__.py", "graph.py")
)
_DEPRECATED = os.sep + "typing_extensions.py"
_internal: dict[CodeType, bool] = {}
_shown: dict[str, str] = {}


def _is_internal(code: CodeType) -> bool:
    known = _internal.get(code)
    if known is None:
        filename = code.co_filename
        known = (
            filename.startswith(_INTERNAL)
            or filename.startswith("<frozen")
            # The standard library (multiprocessing, threading) is nobody's training code.
            or (filename.startswith(_STDLIB) and not filename.startswith(_INSTALLED))
            # Nor typing_extensions' @deprecated wrapper, which torch 2.13 puts around
            # dist.all_gather_into_tensor and dist.reduce_scatter_tensor.
            or filename.endswith(_DEPRECATED)
        )
        _internal[code] = known
    return known


def _show(filename: str) -> str:
    shown = _shown.get(filename)
    if shown is None:
        shown = filename
        try:
            relative = os.path.relpath(filename)
        except ValueError:
            relative = filename
        if not relative.startswith(".."):
            shown = relative
        _shown[filename] = shown
    return shown


def user_line(skip: int = 1) -> str:
    """``file:line`` of the innermost caller outside torch and detctx, or ``<unknown>``."""
    frame: FrameType | None = sys._getframe(skip)
    internal = _internal
    while frame is not None:
        code = frame.f_code
        known = internal.get(code)
        if known is None:
            known = _is_internal(code)
        if not known:
            return f"{_show(code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return UNKNOWN


def user_line_in_backward(skip: int = 1) -> str | None:
    """``file:line`` of user code the backward pass runs (a custom ``backward``, a hook).

    ``None`` when the autograd engine's entry (``torch.autograd.backward`` /
    ``grad``) is reached first: the op belongs to a built-in backward.
    """
    frame: FrameType | None = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if not _is_internal(code):
            return f"{_show(code.co_filename)}:{frame.f_lineno}"
        if code.co_filename.startswith(_ENGINE):
            return None
        frame = frame.f_back
    return None


def defined_at(fn: object) -> str:
    """``file:line`` where the function ``fn`` (or the one a ``partial`` wraps) is defined,
    or ``<unknown>`` for a callable without Python code (a builtin, a C extension)."""
    for _ in range(8):  # partials of partials, decorators' __wrapped__, a few deep at most
        inner = getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    code = getattr(fn, "__code__", None)
    if code is None:  # an object with a __call__ method
        code = getattr(vars(type(fn)).get("__call__"), "__code__", None)
    if not isinstance(code, CodeType):
        return UNKNOWN
    return f"{_show(code.co_filename)}:{code.co_firstlineno}"


def keep_for_backward(outputs: list[torch.Tensor], key: str, where: object) -> None:
    """Keep a forward op's ``where`` in the autograd node that made each output, under
    ``key`` in the node's ``metadata``: the backward ops that node runs read it there."""
    for tensor in outputs:
        node = tensor.grad_fn
        metadata = getattr(node, "metadata", None) if node is not None else None
        if isinstance(metadata, dict):
            metadata.setdefault(key, where)
