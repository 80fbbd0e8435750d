"""What to do when a command's output holds no metric lines, for the frameworks we know,
and when runs differ from their very first metric value.

Lightning prints the loss only in its progress bar, and only when the
``LightningModule`` logs it with ``prog_bar=True``; off a terminal the bar
shows it once per epoch. The Hugging Face Trainer prints ``{'loss': ...}``
every ``logging_steps`` steps (500 by default, often more than a short run
has). Both write files that keep every value at full precision, which
``detctx compare`` reads.
"""

from __future__ import annotations

from typing import Final

from detctx._basics import CAUSES_OF_A_DIFFERENT_START

__all__ = ["FrameworkSigns", "different_start"]

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


def different_start() -> str:
    """Why runs differ from their first metric value on: the likely causes, most likely first."""
    causes = "".join(
        f"\n  {number}. {cause}" for number, cause in enumerate(CAUSES_OF_A_DIFFERENT_START, 1)
    )
    return (
        "The runs differ from the first point on, so they did not start from the same state. "
        f"Likely causes, the most common first:{causes}"
    )
