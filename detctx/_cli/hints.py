"""What to do when a command's output holds no metric lines, for the frameworks we know;
when runs differ from their very first metric value (the cause a run's note tells, else
the likely ones); and when runs agree only through ``$DETCTX_SEED``.

Lightning prints the loss only in its progress bar, and only when the
``LightningModule`` logs it with ``prog_bar=True``; off a terminal the bar
shows it once per epoch. The Hugging Face Trainer prints ``{'loss': ...}``
every ``logging_steps`` steps (500 by default, often more than a short run
has). Both write files that keep every value at full precision, which
``detctx compare`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from detctx._basics import CAUSES_OF_A_DIFFERENT_START, SEED_ENV, EntryNote

__all__ = [
    "FrameworkSigns",
    "different_start",
    "exported_seed",
    "noted_cause",
    "two_environments",
]

_LOCATE: Final = "`detctx run --locate` names the first op where the runs part, and its line."

_RECORD: Final = (
    "Runs in two environments (two machines, devices or releases of torch, CUDA or a "
    "driver) are expected to differ, from the first op on: other kernels, summing in "
    "another order. Record a run in each, `detctx record -o a.trace -- python train.py`, and "
    "`detctx compare a.trace b.trace` names the first op that differs and what differs "
    "between the environments (`detctx doctor --json > a.json` in each, then `detctx "
    "compare a.json b.json`, lists how the machines differ)."
)

_STREAM_NAMES: Final = {
    "random": "Python's random",
    "numpy": "NumPy's global generator",
    "torch": "torch's global generator",
}

_SIGNS: Final = {
    "Lightning": (
        "`Trainer.fit` stopped",
        "GPU available:",
        "LightningModule",
        "lightning.pytorch",
        "pytorch_lightning",
        "lightning_fabric",
    ),
    "Hugging Face Trainer": (
        "***** Running training *****",
        "'train_runtime'",
        "transformers",
    ),
}

_ADVICE: Final = {
    "Lightning": (
        "the output looks like Lightning's, which prints metrics only in its progress bar: "
        "log the loss with self.log('train_loss', loss, prog_bar=True), or better, give the "
        "Trainer a CSVLogger and compare its files at full precision: detctx compare "
        "lightning_logs/version_0/metrics.csv lightning_logs/version_1/metrics.csv "
        "(or pass --pattern to match your own lines)"
    ),
    "Hugging Face Trainer": (
        "the output looks like the Hugging Face Trainer's, which prints {'loss': ...} every "
        "logging_steps steps (500 by default): set logging_steps=1 in TrainingArguments, or "
        "compare each run's trainer_state.json at full precision: detctx compare "
        "run1/checkpoint-N/trainer_state.json run2/checkpoint-N/trainer_state.json "
        "(or pass --pattern to match your own lines)"
    ),
}


class FrameworkSigns:
    """Watches output lines for signs of a framework; :meth:`advice` says what to do."""

    def __init__(self) -> None:
        self.seen: str | None = None

    def feed(self, line: str) -> None:
        if self.seen is not None:
            return
        for framework, signs in _SIGNS.items():
            if any(sign in line for sign in signs):
                self.seen = framework
                return

    def advice(self) -> str:
        """What to do for the framework seen, or ``""`` when none was."""
        return _ADVICE[self.seen] if self.seen is not None else ""


def different_start(
    points: int, cause: str = "", *, environments: Sequence[str] | None = None
) -> str:
    """Why runs differ from their first metric value on: ``cause`` when a run told it
    (:func:`noted_cause`), else the likely causes, most likely first; then how to find
    the op. ``points``: how many each curve has (one value cannot say when they parted).

    ``environments`` is for logs, which may come from two machines: ``None`` when the
    runs ran in one environment (``detctx run``), else what the logs show differently
    (:func:`~detctx._cli.log_environment.environment_differences`). Logs that show two
    environments are told they are expected to differ; logs that show none are told
    both: two environments, or a start that differs.
    """
    if environments:
        parted = "at their only metric value" if points == 1 else "from the first point on"
        return (
            f"The runs differ {parted}, and {_shown(environments)} {_RECORD}\n"
            "Should two runs in one environment differ too, `detctx run -- python train.py` "
            "there says why."
        )
    if points == 1:
        head = (
            "The runs differ at their only metric value, so they may not have started from "
            "the same state (one value cannot tell when they parted)."
        )
    elif environments is None:
        head = "The runs differ from the first point on, so they did not start from the same state."
    else:
        head = (
            "The runs differ from the first point on: they ran in two environments, or they "
            "did not start from the same state."
        )
    if environments is not None:
        head += f" {_RECORD}\nIf they ran in one environment:"
    if cause:
        return f"{head} {cause}\n{_LOCATE}"
    causes = "".join(
        f"\n  {number}. {cause}" for number, cause in enumerate(CAUSES_OF_A_DIFFERENT_START, 1)
    )
    return f"{head} Likely causes, the most common first:{causes}\n{_LOCATE}"


def two_environments(differences: Sequence[str]) -> str:
    """What to know when logs that part after their first point show two environments
    (:func:`~detctx._cli.log_environment.environment_differences`), or ``""``."""
    return f"Note: {_shown(differences)} {_RECORD}" if differences else ""


def _shown(differences: Sequence[str]) -> str:
    return f"the logs show two environments ({'; '.join(differences)})."


def noted_cause(notes: Sequence[EntryNote | None]) -> str:
    """The cause of a different start that the runs' notes tell, or ``""`` when they do not.

    A run that entered no block sent no note; a global generator that drew before
    the first block, in a different state in each run, built something from it there.
    """
    if not notes:
        return ""
    if all(note is None for note in notes):
        return (
            "No run entered a detctx block or called detctx.seed_all (each tells detctx run "
            "when it does), so detctx seeded nothing: wrap the training in `with "
            "detctx.deterministic(seed=...)` or call detctx.seed_all(...) first."
        )
    if any(note is None for note in notes):
        return ""
    first = notes[0]
    assert first is not None
    if any(note is not None and note.seed != first.seed for note in notes):
        seeds = ", ".join(str(note.seed) for note in notes if note is not None)
        return (
            f"The runs' first blocks had different seeds ({seeds}), each chosen by its run: "
            "give the block a fixed one, deterministic(seed=1234)."
        )
    apart = [
        stream
        for stream in ("torch", "numpy", "random")
        if all(note is not None and stream in note.drawn for note in notes)
        and len({note.drawn[stream] for note in notes if note is not None}) > 1
    ]
    if apart:
        names = " and ".join(_STREAM_NAMES[stream] for stream in apart)
        return (
            f"Every run entered its first detctx block after drawing from {names}, which "
            f"{'was' if len(apart) == 1 else 'were'} in another state in each run: whatever "
            "drew those numbers (the model's initial weights, the data, a random split) was "
            "made before the block and differs. Create it inside the block, or call "
            "detctx.seed_all(seed) before it."
        )
    return (
        f"Every run entered its first detctx block with seed {first.seed}, and nothing drawn "
        "before it from Python's, NumPy's or torch's global generator differed, so the "
        "difference most likely comes from a generator detctx does not seed: an unseeded "
        "random.Random(), np.random.default_rng() or torch.Generator(), os.urandom, the "
        "clock. Derive it from the run's seed, or register it with detctx.register_source."
    )


def exported_seed(notes: Sequence[EntryNote | None], seed: int) -> str:
    """What to know when a run's block took its seed from the ``DETCTX_SEED`` that only
    ``detctx run`` exported, or ``""``: plain runs of the script draw a fresh seed."""
    exported = [note for note in notes if note is not None and note.seed_from == "environment"]
    if not exported:
        return ""
    if exported[0].block == "distributed_deterministic":
        block, plain = "distributed_deterministic", "run without detctx run (torchrun train.py)"
        drawn = f"{block}(seed=None) draws a fresh seed, which the ranks agree on"
    else:
        block, plain = "deterministic", "run as a plain `python train.py`"
        drawn = f"{block}(seed=None) (or seed_all()) draws a fresh seed"
    return (
        f"Note: the runs took their seed from {SEED_ENV}={seed}, which detctx run exports: "
        f"{plain}, {drawn}, so plain runs will not reproduce. Give the seed in the script, "
        f"{block}(seed={seed}), or export {SEED_ENV}={seed} wherever it runs."
    )
