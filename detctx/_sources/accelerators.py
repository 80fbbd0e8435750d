"""Accelerator RNG sources: one code path for CUDA, NPU, XPU, MPS and the rest.

An accelerator is a torch device type whose device module (``torch.cuda``,
``torch.npu`` once torch_npu is imported, ...) offers the usual RNG functions.
The backends differ only in the module that is looked up; a new backend is a
call to :func:`register_accelerator`, and the privateuse1 backend (torch_npu's
``npu``) is picked up by name.

Never waking a device
---------------------
Reading a device's RNG state initialises it (a CUDA context, NPU init, GPU
memory). So for a device the program has not initialised yet, detctx does not
read it: it seeds it through the module's lazy path (``manual_seed_all``,
queued until first use), and on exit takes that queued seed back out again.
Taking it back uses the module's lazy queue (``_queued_calls`` and, on CUDA
and XPU, ``_lazy_seed_tracker``), which PyTorch does not expose publicly; where
that queue is not found, or was changed by someone else inside the block, the
device is re-seeded lazily with the seed in force before the block instead
(taken to be the CPU generator's seed, which ``torch.manual_seed`` sets on
every device at once). If the device is initialised *inside* the block, its
generators are re-seeded with that seed on exit: the same as if the block had
never run, unless the device had been seeded on its own
(``torch.cuda.manual_seed_all(s)`` without ``torch.manual_seed``).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import detctx._sources.checks as checks
import detctx._sources.plain as plain
from detctx._basics import CheckpointError, DeterminismWarning, process_cache, warn_at_user
from detctx._sources.lazy_queue import QueuedEntry, QueueMark

__all__ = [
    "AcceleratorSource",
    "active_accelerators",
    "device_module",
    "is_accelerator_name",
    "register_accelerator",
]

_accelerator_types: list[str] = ["cuda", "xpu", "mps"]
_sources: dict[str, AcceleratorSource] = {}
_present_cache: tuple[object, list[AcceleratorSource]] | None = None
_npu_import_tried = False


@process_cache
def _forget_present() -> None:
    # The present sources are built on the device modules seen at discovery; a backend
    # patched or swapped since (a test's monkeypatch undone) needs a fresh discovery.
    global _present_cache
    _present_cache = None


def register_accelerator(device_type: str) -> None:
    """Manage the RNG of every device of ``device_type`` (``"hpu"``, say).

    The type's device module (``torch.get_device_module(device_type)``) must
    offer ``is_available``, ``get_rng_state``, ``set_rng_state`` and
    ``manual_seed_all`` (or ``manual_seed``), like ``torch.cuda`` does. The
    privateuse1 backend (torch_npu's ``npu``) needs no registration.

    A name torch has no device module for (``"CPU"``, ``"cuda:0"``,
    ``"meta"``), or whose module lacks one of those functions, raises
    ``ValueError`` naming what is missing, and nothing is registered::

        import habana_frameworks.torch        # registers torch.hpu
        detctx.register_accelerator("hpu")
    """
    global _present_cache
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a non-empty string, got {device_type!r}")
    if device_type == "cpu":
        raise ValueError("the CPU generator is the built-in 'torch' source, not an accelerator")
    _check_device_module(device_type)
    if device_type not in _accelerator_types:
        _accelerator_types.append(device_type)
    _present_cache = None


_RNG_FUNCTIONS = ("is_available", "get_rng_state", "set_rng_state")


def _check_device_module(device_type: str) -> None:
    """Refuse a name that is not a bare device type with a device module offering RNG calls."""
    if device_type != device_type.strip().lower() or ":" in device_type:
        raise ValueError(
            f"register_accelerator takes a device type such as 'cuda' or 'hpu', not "
            f"{device_type!r}: pass the type alone, in lower case, without a device index"
        )
    module = device_module(device_type)
    if module is None or module is getattr(torch, "cpu", None):
        raise ValueError(
            f"torch has no device module for {device_type!r} (torch.get_device_module"
            f"({device_type!r}) fails): import the package that registers that backend "
            "before calling register_accelerator"
        )
    missing = [name for name in _RNG_FUNCTIONS if not callable(getattr(module, name, None))]
    if not callable(getattr(module, "manual_seed_all", None)) and not callable(
        getattr(module, "manual_seed", None)
    ):
        missing.append("manual_seed_all (or manual_seed)")
    if missing:
        raise ValueError(
            f"the device module for {device_type!r} ({getattr(module, '__name__', module)}) "
            f"lacks the RNG function(s) detctx needs: {', '.join(missing)}"
        )


def is_accelerator_name(name: str) -> bool:
    """Whether ``name`` is (or would be) the source name of an accelerator type."""
    return name in _accelerator_types or name == _privateuse1_name()


def _privateuse1_name() -> str:
    return str(torch._C._get_privateuse1_backend_name())


def device_module(device_type: str) -> Any:
    """torch's device module for ``device_type`` (``torch.cuda``, ``torch.npu``), or None."""
    get = getattr(torch, "get_device_module", None)  # torch >= 2.3
    if get is not None:
        try:
            return get(device_type)
        except (RuntimeError, AttributeError, ValueError):
            return None
    return getattr(torch, device_type, None)


def _import_torch_npu() -> None:
    """Import torch_npu if it is installed and not imported yet, warning on failure.

    torch >= 2.5 usually imports it already through the ``torch.backends``
    entry point; older torch needs the explicit import.
    """
    global _npu_import_tried
    if _npu_import_tried:
        return
    _npu_import_tried = True
    if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is None:
        return
    try:
        importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as exc:
        warn_at_user(
            f"torch_npu is installed but could not be imported ({type(exc).__name__}: {exc}); "
            "NPU RNG state is not managed. On a machine without Ascend's CANN libraries, "
            "uninstall torch_npu or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 before importing torch.",
            DeterminismWarning,
        )


def active_accelerators() -> list[AcceleratorSource]:
    """The accelerator sources of the device types that are available now.

    Cached until the privateuse1 backend is renamed or a type is registered,
    so a block pays for discovery once, not on every entry.
    """
    global _present_cache
    _import_torch_npu()
    key = _privateuse1_name()
    if _present_cache is not None and _present_cache[0] == key:
        return _present_cache[1]
    names = list(_accelerator_types)
    if key != "privateuseone" and key not in names:
        names.append(key)
    present = []
    for name in names:
        module = device_module(name)
        if module is None or not _available(module):
            continue
        source = _sources.get(name)
        if source is None or source.module is not module:
            source = _sources[name] = AcceleratorSource(name, module)
        present.append(source)
    _present_cache = (key, present)
    return present


def _available(module: Any) -> bool:
    is_available = getattr(module, "is_available", None)
    if is_available is None or getattr(module, "get_rng_state", None) is None:
        return False
    try:
        return bool(is_available())
    except Exception:  # a broken backend is an absent one, not a crash
        return False


_REMEMBERED_SEEDS = 16


@dataclass(frozen=True)
class Uninitialised:
    """The captured state of a device type that was not initialised yet.

    ``seed_before`` is the seed taken to be pending for it (the CPU
    generator's seed); ``mark`` is where its lazy queue stood, if readable.
    """

    seed_before: int
    mark: QueueMark | None


class AcceleratorSource:
    """All devices of one accelerator type, as one RNG source.

    Checkpoint forms: ``"accelerator"``, one state tensor per device; and
    ``"accelerator-uninitialised"``, the seed that was pending for a device
    type the program had not used (the lazy queue it was read from belongs
    to the process, so restoring re-queues the seed instead of rewinding a
    queue).
    """

    checkpoint_kinds: ClassVar[frozenset[str]] = frozenset(
        {"accelerator", "accelerator-uninitialised"}
    )

    def __init__(self, device_type: str, module: Any) -> None:
        self.device_type = device_type
        self.module = module
        self._is_initialized: Callable[[], bool] = getattr(module, "is_initialized", lambda: True)
        self._seed_all: Callable[[int], None] = (
            getattr(module, "manual_seed_all", None) or module.manual_seed
        )
        self._indexed = _takes_device_argument(module.get_rng_state)
        # The queue mark right after this source's own last lazy seed, and that seed.
        self._queued: tuple[QueueMark | None, int] | None = None
        # What a lazy seed call added to the queue, by seed, to re-append without a new call.
        self._entries: dict[int, QueuedEntry] = {}

    def is_initialized(self) -> bool:
        """Whether the device type has been initialised in this process."""
        return bool(self._is_initialized())

    def device_count(self) -> int:
        count = getattr(self.module, "device_count", None)
        return int(count()) if count is not None else 1

    def state_count(self) -> int:
        """How many per-device states ``capture`` returns for an initialised device type."""
        return self.device_count() if self._indexed else 1

    def capture(self) -> Any:
        if not self.is_initialized():
            return Uninitialised(
                torch.default_generator.initial_seed(), QueueMark.take(self.module)
            )
        get = self.module.get_rng_state
        if not self._indexed:
            return (get(),)
        return tuple(get(i) for i in range(self.device_count()))

    def restore(self, state: Any) -> None:
        if isinstance(state, Uninitialised):
            self._restore_pending(state)
            return
        set_state = self.module.set_rng_state
        if not self._indexed:
            set_state(state[0])
            return
        for index, device_state in enumerate(state):
            set_state(device_state, index)

    def _restore_pending(self, state: Uninitialised) -> None:
        if not self.is_initialized():
            if state.mark is not None and state.mark.rewind():
                return
            self._lazy_seed(state.seed_before)
            return
        # Initialised inside the block: the pending seed would have been applied
        # at initialisation, and the stream would start from there.
        self._queued = None
        self._seed_all(state.seed_before)

    def seed(self, seed: int) -> None:
        if self.is_initialized():
            self._queued = None
            self._seed_all(seed)
        else:
            self._lazy_seed(seed)

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        if isinstance(state, Uninitialised):
            return "accelerator-uninitialised", {"seed_before": int(state.seed_before)}
        return "accelerator", {"devices": [device_state.clone() for device_state in state]}

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        if kind == "accelerator-uninitialised":
            seed_before = checks.check_fields(stored, "seed_before")["seed_before"]
            checks.check_pending_seed(seed_before)
            return Uninitialised(seed_before, None)
        devices = checks.check_fields(stored, "devices")["devices"]
        if not isinstance(devices, list) or not devices:
            raise TypeError("devices must be a non-empty list of state tensors")
        present = self.state_count()
        if len(devices) != present:
            raise CheckpointError(
                f"the RNG state dict holds states for {len(devices)} {self.device_type} "
                f"devices, this process sees {present}: restore on the same number of devices "
                "(or make the same devices visible)"
            )
        states = tuple(plain.tensor(device_state, torch.uint8).clone() for device_state in devices)
        checks.check_accelerator(states, self.capture() if self.is_initialized() else None)
        return states

    def _lazy_seed(self, seed: int) -> None:
        """Queue ``seed`` for initialisation, paying for a lazy call only when needed.

        Each lazy call formats a stack trace (and torch_npu appends it to a
        list that only initialisation empties). So when the queue still ends
        with this source's own seed of the same value, nothing is queued; and
        a seed queued before (then taken back out on a block's exit) is put
        back by re-appending the entry that call made, not by a new call.
        """
        before = QueueMark.take(self.module)
        if self._queued is not None:
            mark, queued_seed = self._queued
            if queued_seed == seed and mark is not None and mark.same_as(before):
                return
        entry = self._entries.get(seed)
        if before is not None and entry is not None and before.append(entry):
            self._queued = (QueueMark.take(self.module), seed)
            return
        self._seed_all(seed)
        after = QueueMark.take(self.module)
        self._queued = (after, seed)
        if before is not None and after is not None:
            added = before.added_by(after)
            if added is not None:
                if len(self._entries) >= _REMEMBERED_SEEDS:
                    self._entries.pop(next(iter(self._entries)))
                self._entries[seed] = added


def _takes_device_argument(get_rng_state: Callable[..., Any]) -> bool:
    try:
        return bool(inspect.signature(get_rng_state).parameters)
    except (TypeError, ValueError):
        return True
