"""Resume anywhere: a shuffled, multi-worker loader and the RNGs, in one checkpoint entry.

:func:`resumable_loader` builds a ``torchdata`` ``StatefulDataLoader`` (the
loader's position: sampler order, batches served, each worker's state) with
detctx's loader generator and worker seeding, and closes the two gaps that
loader leaves for bit-exact resumption:

- Its sampler saves the generator state from the *start* of the epoch and,
  on load, replays the epoch's permutation from it; the base seed the loader
  drew for its workers right after that permutation is restored as a number,
  not drawn again. So after a resume the generator stands one draw short of
  where it stood in the straight run, and every later epoch is shuffled
  differently. Reproduce (torchdata 0.11)::

      python -c "import torch; from torchdata.stateful_dataloader import StatefulDataLoader as L
      a = L(range(8), shuffle=True, generator=torch.Generator().manual_seed(0)); it = iter(a)
      next(it); s = a.state_dict(); list(it); e1 = list(a)
      b = L(range(8), shuffle=True, generator=torch.Generator().manual_seed(0))
      b.load_state_dict(s); list(b); print(e1 == list(b))"         # False

  The loader (:mod:`detctx._data.loader_state`) keeps the generator state
  from right after the epoch's iterator was made, and puts it back once the
  resumed iterator is made.
- Workers' RNG streams are not saved; :class:`detctx._data.worker_streams.WorkerStreams`
  rides them in each worker's dataset state.

:func:`resume_state` and :func:`resume` put this process's RNG states
(:func:`detctx.capture`) and the loaders' positions in one plain dict with a
digest of all of it, which ``torch.load(..., weights_only=True)`` reads back.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any, Final

from detctx._basics import CheckpointError, open_envelope
from detctx._data.elastic import ElasticLoader
from detctx._data.loader import current_rank, loader_generator, seed_worker
from detctx._data.loader_state import LOADER_FORMAT, is_resumable, resumable_class
from detctx._data.placement import check_placement, placement, run_key, through_dcp
from detctx._data.samplers import prepare_samplers
from detctx._data.together import ResumePlan, resume_together
from detctx._data.untrusted import digest, keys_of, same_plain
from detctx._data.worker_streams import WorkerStreams
from detctx._state import Snapshot, capture
from detctx.distributed import DEFAULT_TIMEOUT_S

__all__ = [
    "LOADER_FORMAT",
    "RESUME_FORMAT",
    "prepare_resume",
    "resumable_loader",
    "resume",
    "resume_state",
]

RESUME_FORMAT: Final = "detctx.resume"
"""The ``"format"`` entry of :func:`resume_state`'s dict."""

# 2: a digest of the whole state, the RNG half included; 3: where it was saved (rank, world
# size, run), inside the digest
_VERSION: Final = 3
_DIGESTED: Final = ("format", "version", "where", "rng", "loaders")
_KEYS: Final = frozenset({*_DIGESTED, "digest"})


def resumable_loader(dataset: Any, *args: Any, seed: int | None = None, **kwargs: Any) -> Any:
    """A ``DataLoader`` whose position and workers' RNG streams go in a checkpoint.

    Takes ``DataLoader``'s arguments (``batch_size=8, shuffle=True,
    num_workers=2, collate_fn=...``) and returns a ``torchdata``
    ``StatefulDataLoader`` (``pip install 'detctx[resume]'``) with:

    - ``generator=detctx.loader_generator(seed, rank=0)`` unless one is
      given: the order and the workers' base seeds come from ``seed`` (or
      the enclosing block's seed when ``seed`` is ``None``), the same on
      every rank, so that a distributed sampler wrapped around the loader's
      sampler (Lightning's ``ddp``, ``ddp_spawn``) splits one order into
      disjoint shards;
    - ``worker_init_fn=functools.partial(detctx.seed_worker, rank=r)``
      unless one is given, ``r`` being this process's rank: each rank's
      workers get their own streams;
    - the dataset wrapped so that each worker's RNG states (Python, NumPy,
      torch CPU, registered sources) are part of the loader's state.

    ``state_dict()`` holds the sampler's position, each worker's streams
    after the last batch the main process took from it, the generator as
    it stood before and after the current epoch's draws, the sampler's epoch
    and the configuration (workers, batch size, dataset length, sampler, rank
    and world size); ``load_state_dict()`` checks all of it against this
    loader (:class:`~detctx.CheckpointError` otherwise) and makes the next
    ``iter()`` continue that epoch where it stopped, and later epochs shuffle
    as they would have. Use it through :func:`resume_state` / :func:`resume`,
    or hand it to a framework that saves loaders with ``state_dict``
    (Lightning 2.3+).

    ``sampler=``: torch's ``RandomSampler`` (with or without replacement),
    ``SubsetRandomSampler`` and ``WeightedRandomSampler`` with a generator of
    their own resume by replaying their epoch from its start; a
    ``DistributedSampler`` or ``SequentialSampler`` resumes as it is (the
    epoch is saved); a sampler with ``state_dict`` / ``load_state_dict``
    answers for itself. ``batch_sampler=``: torch's ``BatchSampler`` around
    one of those, or one with ``state_dict`` / ``load_state_dict``. Anything
    else raises here, before a loader exists: a random sampler without a
    generator (``ValueError``: its order comes from the global stream), or
    sharing the loader's (``ValueError``), another kind (``TypeError``).

    The dataset must be map-style (``TypeError`` otherwise), and
    ``in_order=False`` is refused (``ValueError``): out-of-order batches have
    no position to resume from.
    """
    if kwargs.get("in_order", True) is not True:
        raise ValueError(
            "resumable_loader needs in_order=True (the default): with in_order=False, "
            "batches arrive in the order workers finish them, so no saved position "
            "resumes the same sequence"
        )
    streams = WorkerStreams(dataset)
    if kwargs.get("generator") is None:
        # One order on every rank: Lightning's distributed sampler wrapper shards the
        # order each rank's sampler draws, assuming all ranks draw the same one (a per-rank
        # order gave 2 ranks 11 shared samples of 32). The rank goes into the workers' seeds.
        kwargs["generator"] = loader_generator(seed, rank=0)
    elif seed is not None:
        raise TypeError("pass either seed= or generator= to resumable_loader, not both")
    if kwargs.get("worker_init_fn") is None:
        kwargs["worker_init_fn"] = functools.partial(seed_worker, rank=current_rank())
    loader_class = resumable_class()
    prepare_samplers(kwargs)
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital on every construction, which torch 2.13
        # deprecates: python -W error -c "from torchdata.stateful_dataloader import
        # StatefulDataLoader as L; L([1])"   (UserWarning: 'set_vital' is deprecated)
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return loader_class(streams, *args, **kwargs)


def resume_state(*loaders: Any) -> dict[str, Any]:
    """Everything a run needs to continue exactly from here, as one plain dict.

    ``{"format": "detctx.resume", "version": 3, "where": ..., "rng": ...,
    "loaders": [...], "digest": ...}``: where it was saved (``{"rank",
    "world_size", "run"}``: this process's rank and world size, and an id
    shared by every process of this launch), every RNG of this process
    (``detctx.capture().state_dict()``), each loader's ``state_dict()`` (its
    position, and the configuration and rank it was saved with, which
    :func:`resume` checks) and a digest of all of it, by which :func:`resume`
    refuses a corrupted or edited state. Save it with the model and
    optimiser, one file per rank; it loads with
    ``torch.load(..., weights_only=True)``::

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "detctx": detctx.resume_state(loader)}, path)
    """
    _check_loaders(loaders)
    state = {
        "format": RESUME_FORMAT,
        "version": _VERSION,
        "where": placement(),
        "rng": capture().state_dict(),
        "loaders": [loader.state_dict() for loader in loaders],
    }
    state["digest"] = digest(state)
    return state


def resume(
    state: Mapping[str, Any],
    *loaders: Any,
    strict: bool = True,
    any_rank: bool = False,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Continue from :func:`resume_state`'s dict: every RNG now, each loader at its next ``iter()``.

    ``loaders`` are the same loaders, in the same order, built the same way
    as in the run that saved ``state``. Everything is checked first, and
    :class:`~detctx.CheckpointError` is raised with nothing changed (RNGs and
    loaders alike) for: a dict of another format or version (version 1,
    saved before resume states held a digest of their RNG states, included);
    a state saved on another rank or world size (``any_rank=True`` takes it
    as meant: that rank's streams become this rank's; a resumable loader's
    own rank check still holds); a different number of loaders, or one loader
    passed twice; a loader in the middle of
    an epoch (an iterator of it is live); a loader built differently (its
    ``num_workers``, batch size, ``drop_last``, dataset length or sampler) or
    on another rank or world size than the one that saved the state, named
    in the message; any count, seed or RNG state of a loader's position that
    this loader cannot have reached; RNG states that do not fit this
    process's sources (see :meth:`detctx.Snapshot.from_state_dict`;
    ``strict=False`` skips sources either side lacks); last, anything changed
    after it was saved (the digest of the whole state, the RNG states
    included, does not match: a checksum against corruption and edits, not a
    signature against someone who computes it again). If restoring an RNG
    raises, the loaders are put back as they were too::

        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        detctx.resume(checkpoint["detctx"], loader)

    In a process group of more than one rank it is a collective over
    ``group`` (default: the innermost ``distributed_deterministic`` block's
    group, else the default group): every rank must call it, and either every
    rank resumes or every rank raises the same :class:`~detctx.CheckpointError`,
    naming the ranks that refused and why, with nothing changed on any rank;
    ranks whose states were saved by different runs are refused too. A rank
    that waits more than ``timeout`` seconds for the others raises
    :class:`~detctx.SeedAgreementError` with nothing changed.
    """
    resume_together(
        lambda: prepare_resume(state, loaders, strict=strict, any_rank=any_rank),
        group=group,
        timeout=timeout,
        what="detctx.resume",
    )


def prepare_resume(
    state: Mapping[str, Any], loaders: tuple[Any, ...], *, strict: bool, any_rank: bool
) -> ResumePlan:
    """Every check of :func:`resume` on this rank, nothing changed: what to apply."""
    _check_loaders(loaders)
    state = open_envelope(
        state,
        RESUME_FORMAT,
        _VERSION,
        what="the resume state",
        refusal="not a detctx resume state",
        hint="pass the dict detctx.resume_state() returned",
    )
    _check_keys(state)
    where = state["where"] if state["version"] >= 3 else None
    if state["version"] >= 3:
        check_placement(where, any_rank=any_rank)
    saved = state.get("loaders")
    if not isinstance(saved, list) or len(saved) != len(loaders):
        count = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(
            f"the resume state holds {count} loader state(s) but {len(loaders)} loader(s) were "
            "passed: pass the loaders the run was saved with, in the same order"
        )
    if not isinstance(state.get("rng"), Mapping):
        raise CheckpointError(
            f"the resume state's 'rng' is {type(state.get('rng')).__name__}, not the dict of RNG "
            "states resume_state saves"
        )
    try:
        snapshot = Snapshot.from_state_dict(state["rng"], strict=strict)
    except CheckpointError as exc:
        hint = through_dcp()
        if not hint or "changed after it was saved" not in str(exc):
            raise
        raise CheckpointError(f"{exc}{hint}") from exc
    for index, (loader, loader_state) in enumerate(zip(loaders, saved)):
        loader.check_state(loader_state, where=f"state['loaders'][{index}]")
    # Last, so that a state a check above refuses is told what differs; this catches what
    # no check can: one valid RNG state put in place of another (a flipped bit of a
    # Mersenne Twister word, a NumPy position one off, a Gaussian cache set).
    digested = [key for key in _DIGESTED if key in state]
    if not same_plain(state["digest"], digest({key: state[key] for key in digested})):
        raise CheckpointError(
            "the resume state was changed after it was saved (its digest does not match what "
            "it holds, RNG states and loaders): a corrupted or edited checkpoint; resume from "
            f"another one{through_dcp()}"
        )
    return ResumePlan(loaders, saved, snapshot, run_key(where))


def _check_keys(state: Mapping[str, Any]) -> None:
    if state["version"] < 2:
        raise CheckpointError(
            f"the resume state has version {state['version']}, saved before resume states "
            "carried a digest of their RNG states, so an edit or a corruption of those would "
            "pass unseen: resume with the detctx that saved it, or take it unchecked in parts "
            "(detctx.Snapshot.from_state_dict(state['rng']).restore() and each loader's "
            "load_state_dict(state['loaders'][i]))"
        )
    # Version 2 was saved before states recorded where: resumed without that check.
    keys = _KEYS if state["version"] >= 3 else _KEYS - {"where"}
    if set(state) != keys:
        raise CheckpointError(
            f"the resume state holds {keys_of(state)}; resume_state saves {sorted(keys)}: "
            "a corrupted or edited checkpoint; resume from another one"
        )


def _check_loaders(loaders: tuple[Any, ...]) -> None:
    for index, loader in enumerate(loaders):
        if not (is_resumable(loader) or isinstance(loader, ElasticLoader)):
            raise TypeError(
                f"{type(loader).__name__} is not a resumable loader, so its position cannot be "
                "saved and checked: build it with detctx.resumable_loader(dataset, ...) (or "
                "detctx.elastic_loader(dataset, ...))"
            )
        first = next(i for i, other in enumerate(loaders) if other is loader)
        if first != index:
            raise CheckpointError(
                f"the same loader is passed twice (loaders {first} and {index}); each loader "
                "has one position: pass each once, in the order they were saved"
            )
