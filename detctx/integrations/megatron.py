"""Megatron and MindSpeed: the tensor-parallel RNG tracker inside every block.

Megatron keeps device RNG states of its own in a tracker
(``megatron.core.tensor_parallel.random.get_cuda_rng_tracker()``): named
states ``'data-parallel-rng'``, ``'model-parallel-rng'`` and
``'expert-parallel-rng'``, which dropout inside tensor-parallel regions draws
from under ``tracker.fork(name)``. :func:`register_tracker` makes them a
detctx RNG source: every block (and :func:`detctx.capture`, ``state_dict()``
and :func:`detctx.verify_across_ranks`) then saves, seeds, restores,
checkpoints and compares them like any other RNG::

    from detctx.integrations import megatron as detctx_megatron

    detctx_megatron.register_tracker()        # once; ranks from Megatron's parallel_state
    with detctx.deterministic(seed=0):        # an eval pass that leaves training's streams alone
        evaluate(model)

Seeding follows Megatron's ``model_parallel_cuda_manual_seed(seed, tp_rank,
ep_rank, etp_rank)`` exactly: ``'data-parallel-rng'`` = ``seed``,
``'model-parallel-rng'`` = ``seed + 2718 + tp_rank``,
``'expert-parallel-rng'`` = ``seed + 1024 + 100 * ep_rank + etp_rank``, each
made the way Megatron's ``tracker.add`` makes it (the current device's
generator seeded, read, and put back). On Ascend, MindSpeed runs the same
tracker through torch_npu's ``transfer_to_npu``, which points ``torch.cuda``'s
RNG calls at ``torch.npu``; this module calls them through ``torch.cuda`` as
Megatron does, so it follows that redirect.

Megatron is never imported here: until the program imports it and builds the
tracker (``model_parallel_cuda_manual_seed``), the source holds nothing and
every call is a no-op, and capturing never touches a device. See
``docs/megatron.md``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from typing import Any, Final

import torch

from detctx._basics import MissingDependencyError, megatron_tracker_seeds
from detctx._sources import InvalidField, register_source
from detctx.distributed import MegatronSeeds
from detctx.integrations._megatron_states import (
    check_seeds,
    device_in_use,
    read_state,
    seeded_state,
    seeds_kept,
    try_on_device,
)

__all__ = [
    "DATA_PARALLEL",
    "EXPERT_PARALLEL",
    "MODEL_PARALLEL",
    "MegatronSeeds",
    "TrackerSource",
    "register_tracker",
    "seeds_from_parallel_state",
    "tracker_seeds",
]

DATA_PARALLEL: Final = "data-parallel-rng"
MODEL_PARALLEL: Final = "model-parallel-rng"
EXPERT_PARALLEL: Final = "expert-parallel-rng"

_RANDOM: Final = "megatron.core.tensor_parallel.random"
_PARALLEL_STATE: Final = "megatron.core.parallel_state"
_LARGEST_SEED: Final = 2**64 - 1  # what torch's manual_seed takes


def tracker_seeds(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> dict[str, int]:
    """The seed of each tracker state, by Megatron's ``model_parallel_cuda_manual_seed``."""
    names = (DATA_PARALLEL, MODEL_PARALLEL, EXPERT_PARALLEL)
    return dict(zip(names, megatron_tracker_seeds(seed, tp_rank, ep_rank, etp_rank)))


class TrackerSource:
    """Megatron's RNG tracker as a detctx RNG source (see :func:`register_tracker`).

    The captured state is ``None`` (no tracker built, or no state in it) or
    ``{"states": {name: uint8 tensor}, "seeds": [int, ...]}``: a copy of
    each named state and of the tracker's record of the seeds it used.
    ``tp_rank``, ``ep_rank`` and ``etp_rank`` default to what Megatron's
    ``parallel_state`` says once its groups are initialised.
    """

    def __init__(
        self, *, tp_rank: int | None = None, ep_rank: int | None = None, etp_rank: int | None = None
    ) -> None:
        self._ranks = {
            "tp_rank": _check_rank(tp_rank, "tp_rank"),
            "ep_rank": _check_rank(ep_rank, "ep_rank"),
            "etp_rank": _check_rank(etp_rank, "etp_rank"),
        }

    def __repr__(self) -> str:
        given = [f"{name}={rank}" for name, rank in self._ranks.items() if rank is not None]
        return f"TrackerSource({', '.join(given)})"

    @staticmethod
    def tracker() -> Any:
        """Megatron's tracker if the program has built one, else ``None`` (nothing is built)."""
        module = sys.modules.get(_RANDOM)
        if module is None:
            return None
        # get_cuda_rng_tracker() builds a tracker when there is none, so look first:
        # python -c "import megatron.core.tensor_parallel.random as r;
        #   r.get_cuda_rng_tracker(); print(r._CUDA_RNG_STATE_TRACKER)"  (megatron-core 0.16)
        # Older releases built it at import and have no such flag.
        if not getattr(module, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True):
            return None
        return module.get_cuda_rng_tracker()

    def rank(self, name: str) -> int | None:
        """``tp_rank``, ``ep_rank`` or ``etp_rank``: as given, else Megatron's, else ``None``."""
        given = self._ranks[name]
        if given is not None:
            return given
        state = sys.modules.get(_PARALLEL_STATE)
        if state is None or not state.model_parallel_is_initialized():
            return None
        if name == "tp_rank":
            return int(state.get_tensor_model_parallel_rank())
        if name == "ep_rank":
            return int(state.get_expert_model_parallel_rank())
        # Releases before expert tensor parallelism, and layouts without its group,
        # use the tensor-parallel rank here (as Megatron's own getter falls back to).
        get = getattr(state, "get_expert_tensor_parallel_rank", None)
        found = get() if get is not None else None
        return int(found) if found is not None else self.rank("tp_rank")

    def capture(self) -> Any:
        tracker = self.tracker()
        states = {} if tracker is None else tracker.get_states()
        if not states:
            return None
        return {
            "states": {name: read_state(value) for name, value in states.items()},
            "seeds": sorted(int(seed) for seed in tracker.seeds_),
        }

    def restore(self, state: Any) -> None:
        tracker = self.tracker()
        if state is None or tracker is None:
            # Nothing was held: states the body added stay, or the model's fork() would fail.
            return
        live = tracker.get_states()
        restored = {}
        for name, saved in state["states"].items():
            current = live.get(name)
            if isinstance(current, torch.Generator):
                current.set_state(saved)  # a graph-safe tracker keeps its generator objects
                restored[name] = current
            else:
                restored[name] = saved.clone()
        tracker.set_states(restored)
        tracker.seeds_ = set(state["seeds"])

    def seed(self, seed: int) -> None:
        tracker = self.tracker()
        live = {} if tracker is None else tracker.get_states()
        known = [name for name in (DATA_PARALLEL, MODEL_PARALLEL, EXPERT_PARALLEL) if name in live]
        if not known:
            return
        seeds = self._seeds_for(seed, known)
        fresh = {
            name: seeded_state(value)
            for name, value in seeds.items()
            if not isinstance(live[name], torch.Generator)
        }
        replaced = [live[name] for name in seeds]
        others = set(live) - set(seeds)
        # Megatron's tracker refuses a seed it has used; keep the others' seeds on record
        # (read before the states are replaced: a graph-safe tracker reseeds them in place).
        kept = seeds_kept(tracker.seeds_, replaced) if others else set()
        for name, value in seeds.items():
            if isinstance(live[name], torch.Generator):
                live[name].manual_seed(value)  # in place: CUDA graphs hold these objects
        tracker.set_states({**live, **fresh})
        tracker.seeds_ = set(seeds.values()) | kept

    def _seeds_for(self, seed: int, names: list[str]) -> dict[str, int]:
        needed = {MODEL_PARALLEL: ("tp_rank",), EXPERT_PARALLEL: ("ep_rank", "etp_rank")}
        ranks = {"tp_rank": 0, "ep_rank": 0, "etp_rank": 0}
        for name in names:
            for rank_name in needed.get(name, ()):
                found = self.rank(rank_name)
                if found is None:
                    raise RuntimeError(
                        f"cannot seed Megatron's {name!r} state: this rank's {rank_name} is "
                        "unknown (megatron.core.parallel_state is not initialised). Initialise "
                        "Megatron's parallel groups before the block, or pass tp_rank=, ep_rank= "
                        "and etp_rank= to register_tracker()"
                    )
                ranks[rank_name] = found
        every = tracker_seeds(seed, ranks["tp_rank"], ranks["ep_rank"], ranks["etp_rank"])
        seeds = {name: every[name] for name in names}
        if len(set(seeds.values())) < len(seeds):
            # Megatron's tracker.add raises here too ("seed ... already exists").
            raise ValueError(
                f"Megatron's seeds collide for these ranks ({ranks}): {seeds}; its tracker "
                "refuses two states with one seed"
            )
        return seeds

    def agreement_parts(self, state: Any) -> list[tuple[str, str | None, Any]]:
        """Each named state with the ranks it must agree with (see ``verify_across_ranks``).

        ``'data-parallel-rng'``: every rank seeded alike; ``'model-parallel-rng'``:
        ranks of the same ``tp_rank``; ``'expert-parallel-rng'``: ranks of the same
        ``ep_rank`` and ``etp_rank``. States of other names, or whose ranks are
        unknown, are not compared.
        """
        if state is None:
            return []
        tp, ep, etp = self.rank("tp_rank"), self.rank("ep_rank"), self.rank("etp_rank")
        scopes: dict[str, str | None] = {
            DATA_PARALLEL: "",
            MODEL_PARALLEL: None if tp is None else f"tp_rank={tp}",
            EXPERT_PARALLEL: None if ep is None or etp is None else f"ep_rank={ep},etp_rank={etp}",
        }
        # Megatron takes any hashable name; a rank's parts are named by text, sorted as text.
        parts = {
            name if isinstance(name, str) else repr(name): (name, value)
            for name, value in state["states"].items()
        }
        if len(parts) < len(state["states"]):
            raise ValueError(
                f"Megatron's tracker states {list(state['states'])} have names "
                "that read alike; give them distinct string names"
            )
        return [(label, scopes.get(name), value) for label, (name, value) in sorted(parts.items())]

    def state_to_plain(self, state: Any) -> Any:
        if state is None:
            return None
        return {
            "states": {name: value.clone() for name, value in state["states"].items()},
            "seeds": list(state["seeds"]),
        }

    def state_from_plain(self, plain: Any) -> Any:
        if plain is None:
            return None
        if not isinstance(plain, Mapping) or set(plain) != {"states", "seeds"}:
            raise InvalidField("state", "must be None or a dict of 'states' and 'seeds'")
        states, seeds = plain["states"], plain["seeds"]
        if not isinstance(states, Mapping) or not isinstance(seeds, list):
            raise InvalidField("state", "'states' must be a dict and 'seeds' a list")
        return {"states": dict(states), "seeds": list(seeds)}

    def validate_state(self, state: Any) -> None:
        """Refuse a state this tracker must not be given, before anything changes.

        Names are strings, states non-empty 1-D uint8 CPU tensors, seeds ints
        that torch can seed with. Where the tracker holds states, each saved
        state must have their size; where the device is in use, each must be
        one its generator takes and gives back unchanged (tried, then put back).
        """
        if state is None:
            return
        states = state["states"]
        if not states:
            raise InvalidField("states", "must hold at least one state (an empty tracker is None)")
        for name, value in states.items():
            if not isinstance(name, str):
                raise InvalidField("states", f"names must be strings, not {name!r}")
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype != torch.uint8
                or value.dim() != 1
                or not value.numel()
                or value.device.type != "cpu"
            ):
                raise InvalidField(f"states[{name!r}]", "must be a non-empty 1-D uint8 CPU tensor")
        if len(state["seeds"]) > len(states):
            # Before anything per seed: a record of 10**6 seeds would be kept, and sorted at
            # every later capture. Megatron's add records one seed per state it adds, and a
            # block's seeding keeps it so (seeds_kept).
            raise InvalidField(
                "seeds",
                f"hold {len(state['seeds'])} seeds for {len(states)} state(s); the tracker "
                "records one seed per state",
            )
        for seed in state["seeds"]:
            if type(seed) is not int or not 0 <= seed <= _LARGEST_SEED:
                raise InvalidField("seeds", f"must be ints in [0, 2**64 - 1], not {seed!r}")
        check_seeds(states, state["seeds"])
        tracker = self.tracker()
        if tracker is None:
            raise InvalidField(
                "states",
                "this process has no Megatron RNG tracker to restore them into: build it "
                "(megatron's model_parallel_cuda_manual_seed) before restoring",
            )
        live = tracker.get_states()
        if live and set(live) != set(states):
            raise InvalidField(
                "states",
                f"names {sorted(states)} differ from the tracker's {sorted(live)}: restore a "
                "checkpoint of the same model and parallel layout",
            )
        sizes = {read_state(value).numel() for value in live.values()}
        for name, value in states.items():
            if sizes and value.numel() not in sizes:
                raise InvalidField(
                    f"states[{name!r}]",
                    f"holds {value.numel()} bytes; the tracker's states hold {min(sizes)}",
                )
        if device_in_use():
            for name, value in states.items():
                try_on_device(name, value)


def _check_rank(rank: object, what: str) -> int | None:
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise TypeError(f"{what} must be a non-negative int or None, got {rank!r}")
    return rank


def register_tracker(
    name: str = "megatron",
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
) -> TrackerSource:
    """Manage Megatron's RNG tracker in every block, snapshot and checkpoint from now on.

    Call it once, before or after Megatron builds its tracker. The ranks
    default to Megatron's ``parallel_state`` (read when they are needed, so
    its groups may be initialised later); pass them for a layout Megatron does
    not know. Returns the source, registered as ``name``
    (``detctx.unregister_source(name)`` stops it). Raises
    :class:`~detctx.MissingDependencyError` without megatron-core, and
    ``TypeError`` for a bad rank, with nothing registered::

        from detctx.integrations.megatron import register_tracker
        register_tracker()
    """
    source = TrackerSource(tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)
    try:
        # Finds the package without importing megatron.core (seconds, and warnings).
        installed = importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        installed = False
    if not installed:
        raise MissingDependencyError(
            "detctx.integrations.megatron needs megatron-core: pip install 'detctx[megatron]'"
        )
    register_source(name, source)
    return source


def seeds_from_parallel_state(*, data_parallel_random_init: bool = False) -> MegatronSeeds:
    """This rank's :class:`~detctx.distributed.MegatronSeeds`, from Megatron's parallel_state.

    ``data_parallel_random_init=True`` adds Megatron's ``10 * dp_rank``, as
    its ``--data-parallel-random-init`` does. Raises ``RuntimeError`` before
    Megatron's parallel groups are initialised::

        stage = seeds_from_parallel_state()
        with detctx.distributed_deterministic(seed=1234, megatron_seeds=stage):
            train()
    """
    if not isinstance(data_parallel_random_init, bool):
        raise TypeError(
            f"data_parallel_random_init must be True or False, got {data_parallel_random_init!r}"
        )
    state = sys.modules.get(_PARALLEL_STATE)
    if state is None or not state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron's parallel groups are not initialised: call it after "
            "initialize_model_parallel(), or build MegatronSeeds(pp_rank=..., dp_rank=...) "
            "yourself"
        )
    dp_rank = int(state.get_data_parallel_rank()) if data_parallel_random_init else None
    return MegatronSeeds(pp_rank=int(state.get_pipeline_model_parallel_rank()), dp_rank=dp_rank)
