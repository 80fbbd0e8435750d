"""The four model families the planting harness (``benchmarks/s14_plantings.py``) trains:
each built from a config at a tiny size, one training step (forward, backward, AdamW).

Each family gives a fresh model and batch for a seed, the settings of kernel noise that
apply to it, and the modules whose configuration a module-level planting may change (a
norm's ``eps``, GELU switched to its tanh form). Dropout sits where the models have it:
GPT-2's embedding, attention and residual dropout, the LSTM's between its layers and
around it; with one seed, on one machine and torch release, both runs draw the same masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "Family", "ModuleChange"]


@dataclass(frozen=True)
class ModuleChange:
    """A change to one module's configuration, made in B only: ``what`` says it in words."""

    path: str  # the module's name in ``named_modules()``
    what: str
    apply: Callable[[nn.Module], nn.Module | None]  # the module -> a replacement, or None


@dataclass(frozen=True)
class Family:
    """A model family: ``build(seed)`` makes the model and its batch, ``loss(model, batch)``
    is the step's loss; ``channels_last``: the "channels_last" setting converts the model
    and the batch's first tensor."""

    name: str
    description: str
    build: Callable[[int], tuple[nn.Module, Any]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    settings: tuple[str, ...]  # the noise settings of s14 that apply
    changes: Callable[[nn.Module], list[ModuleChange]]
    channels_last: bool = False


def _tokens(seed: int, rows: int, length: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=generator)


# --- HF GPT-2 --------------------------------------------------------------------------


def _hf(seed: int, config: Any, model_class: Any) -> tuple[nn.Module, Any]:
    """A transformers causal LM of ``config`` (token ids 0..999, 4x32 tokens)."""
    torch.manual_seed(seed)
    return model_class(config), _tokens(seed, 4, 32, 1000)


def _gpt2(seed: int) -> tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    # activation "gelu" (nn.functional.gelu), so that a block can be switched to the tanh
    # form; GPT-2's own "gelu_new" is the tanh form written out in Python ops.
    config = GPT2Config(
        n_layer=3,
        n_embd=128,
        n_head=4,
        vocab_size=1000,
        n_positions=64,
        activation_function="gelu",
        bos_token_id=0,
        eos_token_id=0,
    )
    return _hf(seed, config, GPT2LMHeadModel)


def _lm_loss(model: nn.Module, tokens: Any) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return loss


def _gpt2_changes(model: nn.Module) -> list[ModuleChange]:
    changes = []
    for block in range(3):
        changes.append(
            ModuleChange(
                f"transformer.h.{block}.mlp.act",
                "GELU switched to approximate='tanh'",
                lambda _: nn.GELU(approximate="tanh"),
            )
        )
        for norm in ("ln_1", "ln_2"):
            changes += _eps_changes(f"transformer.h.{block}.{norm}", "eps")
    return changes + _eps_changes("transformer.ln_f", "eps")


# --- HF Llama --------------------------------------------------------------------------


def _llama(seed: int) -> tuple[nn.Module, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        bos_token_id=0,
        eos_token_id=0,
    )
    return _hf(seed, config, LlamaForCausalLM)


def _llama_changes(model: nn.Module) -> list[ModuleChange]:
    changes = []
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            changes += _eps_changes(f"model.layers.{layer}.{norm}", "variance_epsilon")
    return changes + _eps_changes("model.norm", "variance_epsilon")


# --- a ResNet-style CNN with BatchNorm -------------------------------------------------


class Block(nn.Module):
    """A residual basic block: conv-BN-ReLU-conv-BN, plus a 1x1 conv-BN shortcut on a
    stride or width change."""

    def __init__(self, width_in: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or width_in != width:
            self.shortcut = nn.Sequential(
                nn.Conv2d(width_in, width, 1, stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A stem and three stages of one basic block each (16, 32, 64 channels), then a
    global average pool and a linear classifier: ResNet's shape at a tenth of its size."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.layer1 = Block(16, 16, 1)
        self.layer2 = Block(16, 32, 2)
        self.layer3 = Block(32, 64, 2)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _cnn(seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = SmallResNet()
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(8, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (8,), generator=generator)
    return model, (images, labels)


def _classify(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _cnn_changes(model: nn.Module) -> list[ModuleChange]:
    changes = []
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            changes += _eps_changes(name, "eps")
    return changes


# --- an LSTM language model ------------------------------------------------------------


class LstmLM(nn.Module):
    """Embedding, a 2-layer LSTM (hidden 128, dropout between its layers), a LayerNorm and
    a linear decoder, with dropout before and after the LSTM."""

    def __init__(self, vocab: int = 1000, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.drop = nn.Dropout(0.1)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.drop(self.embed(tokens)))
        return self.decoder(self.norm(self.drop(hidden)))


def _lstm(seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    return LstmLM(), _tokens(seed, 8, 21, 1000)


def _next_token(model: nn.Module, tokens: Any) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def _lstm_changes(model: nn.Module) -> list[ModuleChange]:
    return _eps_changes("norm", "eps")


# --- shared ----------------------------------------------------------------------------


def _eps_changes(path: str, attribute: str) -> list[ModuleChange]:
    """The norm at ``path`` with its eps times 10 and times 2."""

    def times(factor: float) -> Callable[[nn.Module], None]:
        def apply(module: nn.Module) -> None:
            setattr(module, attribute, getattr(module, attribute) * factor)

        return apply

    return [ModuleChange(path, f"{attribute} x{factor:g}", times(factor)) for factor in (10.0, 2.0)]


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "gpt2",
        "HF GPT-2, 3 layers, hidden 128, 4 heads, GELU; 4x32 tokens",
        _gpt2,
        _lm_loss,
        ("same", "onednn_off", "threads_2", "sdpa_math"),
        _gpt2_changes,
    ),
    "llama": Family(
        "llama",
        "HF Llama, 2 layers, hidden 128, 4 heads (2 KV); 4x32 tokens",
        _llama,
        _lm_loss,
        ("same", "onednn_off", "threads_2", "sdpa_math"),
        _llama_changes,
    ),
    "cnn": Family(
        "cnn",
        "ResNet-style CNN, BatchNorm, 3 stages (16/32/64); 8x3x32x32",
        _cnn,
        _classify,
        ("same", "onednn_off", "channels_last", "threads_2"),
        _cnn_changes,
        channels_last=True,
    ),
    "lstm": Family(
        "lstm",
        "LSTM LM, 2 layers, hidden 128, LayerNorm; 8x20 tokens",
        _lstm,
        _next_token,
        ("same", "onednn_off", "threads_2"),
        _lstm_changes,
    ),
}
"""The families, by the name ``--families`` takes."""
