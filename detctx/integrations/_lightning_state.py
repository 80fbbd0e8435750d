"""The Lightning callback's checkpoint entry: every rank's RNG and loader states, checked.

Lightning writes rank 0's checkpoint alone, holding rank 0's loader position
(``loops.fit_loop.state_dict.combined_loader``). The callback's entry holds,
by rank, each rank's RNG state and training loader states; on resume each
rank puts its own loader states where Lightning reads them, before Lightning
restores its loops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from detctx._basics import CheckpointError, open_envelope, validate_seed
from detctx.integrations._ranks import gather_ranks, pick_rank, rank_and_world

__all__ = [
    "STATE_FORMAT",
    "STATE_VERSION",
    "fit_loop_state",
    "gather_every_rank",
    "rank_entry",
    "refuse_unreplayable",
    "saved_seeds",
]

STATE_FORMAT: Final = "detctx.lightning"
STATE_VERSION: Final = 2
"""Version 1 held one process's ``"rng"``; version 2 adds ``"ranks"``: by rank,
``{"rng", "loaders"}``."""


def fit_loop_state(checkpoint: Any) -> dict[str, Any] | None:
    """The fit loop's state in a Lightning checkpoint (``loops.fit_loop.state_dict``)."""
    loops = checkpoint.get("loops") if isinstance(checkpoint, Mapping) else None
    fit_loop = loops.get("fit_loop") if isinstance(loops, Mapping) else None
    state = fit_loop.get("state_dict") if isinstance(fit_loop, Mapping) else None
    return state if isinstance(state, dict) else None


def gather_every_rank(checkpoint: Any, key: str) -> None:
    """Replace the callback's entry ``key`` of ``checkpoint`` (built on every rank, written
    from rank 0) by every rank's RNG and training loader states."""
    entry = checkpoint.get("callbacks", {}).get(key)
    if isinstance(entry, dict) and "rng" in entry:
        fit_state = fit_loop_state(checkpoint) or {}
        loaders = fit_state.get("combined_loader")
        entry["ranks"] = gather_ranks({"rng": entry.pop("rng"), "loaders": loaders})


def saved_seeds(state_dict: Mapping[str, Any], where: str) -> tuple[int, int]:
    """The ``seed`` and ``eval_seed`` a state was saved with (every version saves both),
    each checked as a seed: none, a tensor, a string or a float there is a crafted or
    corrupted state."""
    seeds = []
    for name in ("seed", "eval_seed"):
        value = state_dict.get(name)
        try:
            seeds.append(validate_seed(value, name))
        except (TypeError, ValueError) as exc:
            shown = " ".join(repr(value).split())[:80]
            raise CheckpointError(f"{where} has {name} {shown}: {exc}") from exc
    return seeds[0], seeds[1]


def rank_entry(state_dict: Any, where: str) -> tuple[Any, list[Any] | None]:
    """This rank's RNG state dict and training loader states (``None``: none saved).

    Raises :class:`~detctx.CheckpointError` for another format or version, a
    missing state, or a checkpoint saved by another number of processes."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"{where} is a {type(state_dict).__name__}, not the dict DeterministicCallback "
            "saves; was it written by another callback?"
        )
    state_dict = open_envelope(
        state_dict,
        STATE_FORMAT,
        STATE_VERSION,
        what=where,
        refusal=f"{where} is not DeterministicCallback's state",
        hint="was it written by another callback?",
    )
    if "ranks" in state_dict:
        own = pick_rank(state_dict["ranks"], where)
        if not isinstance(own, Mapping) or "rng" not in own:
            raise CheckpointError(f"{where} has a rank state without 'rng'")
        loaders = own.get("loaders")
        if loaders is not None and not isinstance(loaders, list):
            raise CheckpointError(f"{where} has a rank's loader states that are not a list")
        return own["rng"], loaders
    if "rng" not in state_dict:
        raise CheckpointError(f"{where} has no 'rng' state")
    rank, world = rank_and_world()
    if world != 1:
        raise CheckpointError(
            f"{where} holds one process's RNG state and no loader positions by rank, and is "
            f"resumed by {world} processes (this is rank {rank}): it was saved by an older "
            "detctx or outside a checkpoint. Resume it in one process, or from a checkpoint "
            "this detctx saved on every rank"
        )
    return state_dict["rng"], None


def refuse_unreplayable(trainer: Any) -> None:
    """Raise :class:`~detctx.CheckpointError` when a resumed training loader's order cannot
    be replayed: Lightning's ``DistributedSamplerWrapper`` around a sampler that shuffles
    with the loader's own generator (``resumable_loader(dataset, shuffle=True)``).

    The wrapper draws the inner sampler's whole order at the first batch of each
    epoch, from the loader's generator, which the loader also draws its workers'
    base seed from and puts back on resume; torchdata saves only how many
    indices the wrapper yielded (it has no ``state_dict``), so a resumed
    iterator replays an order drawn from another generator state. Measured (2
    ``ddp_spawn`` ranks, 32 samples, resumed at step 6): other samples from the
    first resumed batch on.
    """
    loader = getattr(trainer, "train_dataloader", None)
    generator = getattr(loader, "generator", None)
    if generator is None or not callable(getattr(loader, "check_state", None)):
        return
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
        if type(sampler).__name__ != "DistributedSamplerWrapper" or (
            getattr(inner, "generator", None) is not generator
        ):
            continue
        raise CheckpointError(
            f"this fit resumes a detctx.resumable_loader whose shuffling Lightning wrapped in "
            f"a DistributedSamplerWrapper for {trainer.world_size} ranks: the wrapper draws "
            "each epoch's order from the loader's generator, which torchdata cannot replay "
            "mid-epoch, so the resumed ranks would read other samples. Give train_dataloader "
            "sampler=torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=...) "
            "instead of shuffle=True (Lightning keeps it, and it resumes exactly), or resume "
            "from a checkpoint saved at an epoch's end"
        )
