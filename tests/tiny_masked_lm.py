"""A tiny Hugging Face masked-LM training, built locally (nothing downloaded), for the tests.

A BertForMaskedLM from a small config, trained on random token ids with
DataCollatorForLanguageModeling, whose random masking draws from torch's
global generator in training and in evaluation alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(27)]


def make_tokenizer(folder: Path) -> Any:
    """A BERT WordPiece tokenizer over :data:`VOCAB`, written to ``folder``."""
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))


def make_datasets() -> tuple[list[dict[str, list[int]]], list[dict[str, list[int]]]]:
    """32 training and 8 evaluation sequences of 12 token ids."""
    generator = torch.Generator().manual_seed(0)

    def token_ids(count: int) -> list[dict[str, list[int]]]:
        return [
            {"input_ids": [2, *torch.randint(5, 32, (10,), generator=generator).tolist(), 3]}
            for _ in range(count)
        ]

    return token_ids(32), token_ids(8)


def make_trainer(
    tokenizer: Any,
    datasets: tuple[Any, Any],
    output_dir: Path,
    *,
    evaluate: bool,
    callbacks: tuple[Any, ...] | list[Any] = (),
    steps: int = 8,
    **arguments: Any,
) -> Any:
    """A Trainer for ``steps`` steps (8 per epoch), logging every step, evaluating every 2 if
    ``evaluate``; ``arguments`` override the ``TrainingArguments``."""
    train_set, eval_set = datasets
    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "logging_steps": 1,
        "eval_strategy": "steps" if evaluate else "no",
        "eval_steps": 2,
        "save_strategy": "no",
        "report_to": [],
        "seed": 7,
        "use_cpu": True,
        "disable_tqdm": True,
    }
    args = transformers.TrainingArguments(**{**settings, **arguments})
    transformers.set_seed(7)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return transformers.Trainer(
        model=transformers.BertForMaskedLM(config),
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
        callbacks=list(callbacks),
    )
