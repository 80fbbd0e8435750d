"""Collectives and distributed tensors among the recorded ops.

**Collectives.** One issued from Python (``dist.all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, FSDP2's all-gathers and
reduce-scatters, the functional ``_c10d_functional`` ops DTensor and
tensor parallelism issue) reaches the recorder as an op (``c10d::allreduce_``,
``_c10d_functional::all_reduce``) that returns before the ranks have
exchanged anything: gloo, NCCL and HCCL run it on their own thread or
stream, and its outputs hold what they held until it completes (two
recordings of one FSDP2 run differed at ``c10d::_allgather_base_``). So a
collective is recorded as an :class:`Issued` op: its inputs' producers when
it is issued, its place (module, the source line that issued it, its group
in the source text), and its outputs read once it has completed. Its row is
written just before the first later op that reads or writes one of its
outputs' memory (a view does neither), after ``Work.wait()`` (a no-op where
the program waited already, as it must before it reads them) or
``wait_tensor`` for a functional one; those still open when the recording
stops are written then, in the order they were issued. Where that row lands
depends only on the program's ops, never on when the collective happened to
complete.

Not recorded: the collectives ``broadcast_object_list``, ``all_gather_object``
and their kin issue, whose tensors hold pickled Python objects, not numbers
(DCP's ``save`` broadcasts its metadata with a random id in each run: two
runs of one program would differ there); point-to-point ``send`` and
``recv`` (waiting for one before the program does can deadlock: its partner
may be waiting for this rank); ``reduce`` (what the ranks other than the
root hold after it is not defined); barriers. What ``recv`` and ``reduce``
write has no producer afterwards. Collectives issued from C++ (DDP's gradient buckets, its
reducer's all-reduces) never reach a dispatch mode and are not seen either:
their results show in the first op that reads them.

**Distributed tensors.** An op on DTensors is seen once, at the DTensor
level (its local computation and any redistribution it runs happen inside
it); its outputs are recorded as this rank's local shards (their local
shapes), the placements named in the source text, and its inputs' producers
are those of their local shards. Plain tensors and DTensors are never
mixed.
"""

from __future__ import annotations

import enum
import itertools
import sys
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch

__all__ = [
    "Issued",
    "Kind",
    "carries_objects",
    "issue",
    "kind",
    "local",
    "placements",
    "plain_tensors",
    "reads",
]


class Kind(enum.Enum):
    """What the recorder does with an op."""

    PLAIN = "an ordinary op"
    COLLECTIVE = "a collective, recorded once it has completed"
    PASSING = "a wait or a wrapper: its output is its input's memory, nothing to record"
    UNSEEN = "not recorded; the memory it writes has no producer afterwards"
    SILENT = "not recorded, writes nothing (a send, a barrier)"


_WRITES_UNSEEN: Final = frozenset({"c10d::recv_", "c10d::recv_any_source_", "c10d::reduce_"})
_SILENT: Final = frozenset({"c10d::send", "c10d::barrier", "c10d::monitored_barrier_"})
_PASSING: Final = frozenset(
    {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd"}
)
_FUNCTIONAL: Final = ("_c10d_functional::", "_c10d_functional_autograd::")
_OBJECTS: Final = frozenset(
    {
        "broadcast_object_list",
        "all_gather_object",
        "gather_object",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    }
)
"""``torch.distributed``'s functions that send pickled Python objects through collectives."""
_kinds: dict[Any, Kind] = {}
_views: dict[Any, bool] = {}


def kind(func: Any) -> Kind:
    """What ``func`` is to the recorder (looked up once per op)."""
    found = _kinds.get(func)
    if found is None:
        name = func._schema.name
        if name in _PASSING:
            found = Kind.PASSING
        elif name in _SILENT:
            found = Kind.SILENT
        elif name in _WRITES_UNSEEN:
            found = Kind.UNSEEN
        elif name.startswith(("c10d::", *_FUNCTIONAL)):
            found = Kind.COLLECTIVE
        else:
            found = Kind.PLAIN
        _kinds[func] = found
    return found


def reads(func: Any) -> bool:
    """Whether ``func`` may read or write its arguments' values: any op but a view."""
    found = _views.get(func)
    if found is None:
        schema = func._schema
        view = bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        written = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        # Wrapping a functional collective's output (before any wait) reads nothing either.
        wraps = schema.name == "_c10d_functional::_wrap_tensor_autograd"
        found = _views[func] = (not view or written) and not wraps
    return found


def carries_objects() -> bool:
    """Whether the collective being issued now sends pickled objects (:data:`_OBJECTS`)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _OBJECTS and code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``tensor``'s values on this rank: a DTensor's local shard,
    an ``AsyncCollectiveTensor``'s result; any other tensor itself."""
    for _ in range(4):  # a DTensor of an AsyncCollectiveTensor at most, in practice
        if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
            return tensor
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is None:
            return tensor
        inner = [getattr(tensor, name) for name in flatten()[0]]  # a DTensor's has its mesh
        held = [value for value in inner if isinstance(value, torch.Tensor)]
        if len(held) != 1:
            return tensor  # a subclass of several tensors is not one rank's values
        tensor = held[0]
    return tensor


def plain_tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors in ``values`` (lists of lists too), each as :func:`local` gives it."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value if type(value) is torch.Tensor else local(value))
        elif isinstance(value, (list, tuple)):
            found.extend(plain_tensors(value))
    return found


def placements(outputs: list[torch.Tensor]) -> str:
    """The placements of the DTensors among ``outputs``, as the source text notes them."""
    seen: list[str] = []
    for tensor in outputs:
        found = getattr(tensor, "placements", None)
        if isinstance(found, tuple):
            text = ", ".join(str(placement) for placement in found)
            if text not in seen:
                seen.append(text)
    return f"DTensor local shard of [{'; '.join(seen)}]" if seen else ""


_sequence = itertools.count()


class Issued:
    """A collective issued and not yet recorded: what its row needs, and how to wait for it."""

    __slots__ = ("inputs", "keys", "number", "outputs", "strings", "wait")

    def __init__(
        self,
        strings: tuple[str, str, str, str, str],
        outputs: list[torch.Tensor],
        inputs: list[tuple[int, int]],
        wait: Callable[[], None],
        keys: list[int | None],
    ) -> None:
        self.strings = strings
        self.outputs = outputs
        self.inputs = inputs
        self.wait = wait
        self.keys = keys
        self.number = next(_sequence)  # the order it was issued in


def issue(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None], str] | None:
    """A collective's inputs and outputs, how to wait for it, and its group in words; ``None``
    where it cannot be waited for (no ``Work`` came back)."""
    arguments = func._schema.arguments
    named = [
        (argument.name, args[index] if index < len(args) else kwargs.get(argument.name))
        for index, argument in enumerate(arguments)
    ]
    if func._schema.name.startswith(_FUNCTIONAL):
        inputs = plain_tensors(value for name, value in named if name != "out")
        outputs = plain_tensors([result])
        group = next((value for name, value in named if name == "group_name"), None)

        def wait_all() -> None:
            for tensor in outputs:
                torch.ops._c10d_functional.wait_tensor(tensor)

        return inputs, outputs, wait_all, _group_text(group)
    inputs = plain_tensors(v for n, v in named if n.startswith("input") or n == "tensors")
    outputs = plain_tensors(v for n, v in named if n.startswith("output") or n == "tensors")
    work = _unboxed("Work", result if isinstance(result, (list, tuple)) else [result])
    if work is None:
        return None
    group = _unboxed("ProcessGroup", [value for _, value in named])
    return inputs, outputs, work.wait, _group_text(group)


def _unboxed(name: str, values: Iterable[Any]) -> Any:
    """The first ``c10d`` object of class ``name`` among ``values`` (``ScriptObject``\\ s)."""
    boxes = getattr(torch._C, "_distributed_c10d", None)
    cls = getattr(boxes, name, None)
    unbox = getattr(cls, "unbox", None)
    if unbox is None:
        return None
    for value in values:
        if isinstance(value, torch.ScriptObject):
            try:
                return unbox(value)
            except RuntimeError:
                continue  # another class of object (a ReduceOp, the group)
    return None


def _group_text(group: Any) -> str:
    """``group <name>: ranks 0,1`` for a process group (or a functional op's group name)."""
    try:
        import torch.distributed as dist

        if isinstance(group, str):
            group = torch._C._distributed_c10d._resolve_process_group(group)  # type: ignore[arg-type]
        if group is None:
            return "group unknown"
        ranks = ",".join(str(rank) for rank in dist.get_process_group_ranks(group))
        return f"group {group.group_name}: ranks {ranks}"
    except (RuntimeError, ValueError, AttributeError, KeyError):
        return "group unknown"
