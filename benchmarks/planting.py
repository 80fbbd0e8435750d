"""Changes planted in run B of the planting harness (``benchmarks/s14_plantings.py``).

An op-level planting changes the output of one recorded op: :class:`Planter`, a
``TorchDispatchMode``, counts the ops the recording records and changes the values of the
chosen one's first floating-point output in place (scaled by ``1 + eps``, or rounded to
bfloat16 and back) before the recorder sees them, so the trace holds the changed output
as that op's own, and every later op reads it.

The mode must sit *below* the recorder's mode: a dispatch mode sees an op before the
modes entered before it, and what it returns is what the mode above it gets. So it is
entered *before* ``detctx.recording`` starts. Entered inside the recording it would see
each op first, call the recorder below it, and change the output after the recorder had
summarised it: the trace would record the op's unchanged output and the change would
show first at the next op that reads it (``check_stacking`` in the harness shows both).

The recorder runs ops of its own inside its dispatch (copies of outputs for its
statistics); below it, those reach this mode too and are not the program's. An op is the
program's when the Python frame that called it (past torch's own) is the recorder's
``dispatch``, or code outside detctx.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import detctx
from benchmarks.planting_models import Family
from detctx._locate import new_values, op_info

__all__ = ["CHANGES", "Plan", "Planter", "noise", "record"]

CHANGES: Final = {
    "x(1+1e-2)": 1e-2,
    "x(1+1e-3)": 1e-3,
    "x(1+1e-4)": 1e-4,
    "bf16": None,
}
"""The op-level changes: the output scaled by ``1 + eps``, or (``None``) rounded to
bfloat16 and back. 1e-4 is a third of float32's tolerance: a sub-tolerance change."""

_DETCTX: Final = str(Path(detctx.__file__).resolve().parent)
_RECORDER: Final = str(Path(_DETCTX, "_compare", "recorder.py"))


def _programs_op(frame: Any) -> bool:
    """Whether the op is the program's: called by the recorder's ``dispatch`` (the op it
    forwards, when this mode is below it) or by code outside detctx (when it is above),
    not by the recorder's own bookkeeping (its statistics and digests); frames inside
    torch are passed over."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        if "/torch/" not in path.replace("\\", "/"):
            if path == _RECORDER:
                return code.co_name == "dispatch"
            return not path.startswith(_DETCTX)
        frame = frame.f_back
    return False


class Planter(TorchDispatchMode):  # type: ignore[misc]
    """Changes the program's recorded op number ``index`` (0-based, as the trace numbers
    them without the rows detctx adds of its own: data no op made), expected to be
    ``name``; ``index=None`` only counts. After the run: ``seen`` (recorded ops counted),
    ``planted_name`` (the op changed, ``None`` if the run had no such op), ``own_error``
    (the change's relative L2 error, exact, in float64)."""

    def __init__(self, index: int | None, name: str, change: str) -> None:
        super().__init__()
        if change not in CHANGES:
            raise ValueError(f"unknown change {change!r}; choose from {list(CHANGES)}")
        self.index = index
        self.name = name
        self.change = change
        self.seen = 0
        self.planted_name: str | None = None
        self.own_error = math.nan

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the recorder's mode: no torch._disable_dynamo wrapper per op

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not _programs_op(sys._getframe(1)):
            return result
        info = op_info(func)
        if info.skip:
            return result
        outputs = new_values(info, args, kwargs, result)
        if not outputs:
            return result
        if self.seen == self.index:
            self.planted_name = info.name
            self._change(outputs)
        self.seen += 1
        return result

    def _change(self, outputs: list[torch.Tensor]) -> None:
        target = next((t for t in outputs if t.is_floating_point()), None)
        if target is None:
            return
        before = target.detach().to(torch.float64)
        eps = CHANGES[self.change]
        if eps is None:
            changed = target.to(torch.bfloat16).to(target.dtype)
        else:
            changed = target * (1.0 + eps)
        target.copy_(changed)  # in place: the program, and the recorder, read this memory
        norm = float(torch.linalg.vector_norm(before))
        delta = float(torch.linalg.vector_norm(target.detach().to(torch.float64) - before))
        self.own_error = delta / norm if norm > 0 else (0.0 if delta == 0 else math.inf)


@contextlib.contextmanager
def noise(setting: str) -> Iterator[None]:
    """Run B's kernel settings (``channels_last`` is a layout, applied to model and batch)."""
    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        if setting == "onednn_off":
            stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        elif setting == "threads_2":
            torch.set_num_threads(2)
            stack.callback(torch.set_num_threads, threads)
        elif setting == "sdpa_math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield


@dataclass(frozen=True)
class Plan:
    """One planting: at recorded op ``index`` (``name``) a change of ``CHANGES``, or the
    module ``module`` changed as ``change`` says."""

    family: str
    setting: str
    phase: str  # forward, backward, optimizer, module
    change: str
    index: int = -1
    name: str = ""
    module: str = ""
    ordinal: int = -1  # the op's place among the program's ops (not detctx's own rows)


def record(
    family: Family,
    model: torch.nn.Module,
    batch: Any,
    setting: str,
    path: Path,
    plan: Plan | None = None,
    inside: bool = False,
) -> Planter | None:
    """One step recorded into ``path``, in ``setting``, with ``plan``'s change made."""

    model = copy.deepcopy(model)
    if plan is not None and plan.phase == "module":
        _change_module(model, family, plan.module, plan.change)
    if family.channels_last and setting == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        batch = (batch[0].contiguous(memory_format=torch.channels_last), batch[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    planter = None
    if plan is not None and plan.phase != "module":
        planter = Planter(plan.ordinal, plan.name, plan.change)
    with noise(setting), contextlib.ExitStack() as stack:
        if planter is not None and not inside:
            stack.enter_context(planter)  # below the recorder: see benchmarks/planting.py
        stack.enter_context(detctx.recording(path))
        if planter is not None and inside:
            stack.enter_context(planter)
        torch.manual_seed(1234)  # the dropout masks: one seed in A and B
        family.loss(model, batch).backward()
        optimizer.step()
    return planter


def _change_module(model: torch.nn.Module, family: Family, path: str, what: str) -> None:
    change = next(c for c in family.changes(model) if c.path == path and c.what == what)
    module = model.get_submodule(path)
    replacement = change.apply(module)
    if replacement is not None:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, replacement)
