"""A small nanoGPT-style training step with dropout on, for the portable random draws'
tests across torch releases (tests/test_trace_portable_random.py).

Dropout after the embeddings, in the attention (SDPA's ``dropout_p``, which a
CPU runs through the math kernel and its ``bernoulli_``), after each
attention and each MLP; the model is built and its data drawn inside the
recording, so its initial weights are portable draws too. ``scale_layer=N``
multiplies layer N's MLP activations by 1.003: the change a comparison names.

The trace recorded on torch 2.1.2 is made again when this file or the trace
format changes, from the project's folder, in an environment with torch 2.1.2
and this detctx installed::

    python tests/portable_gpt.py tests/data/portable-random-torch-2.1.2.trace
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, LAYERS, HEADS, CONTEXT, BATCH, VOCAB, DROPOUT = 32, 1, 2, 16, 2, 40, 0.2
PORTABLE_SEED = 1234
SCALE_LINE = "x = x * 1.003"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        p = DROPOUT if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, *, scaled: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(DROPOUT)
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))
        if self.scaled:
            x = x * 1.003
        return self.dropout(self.c_proj(x))


class Block(nn.Module):
    def __init__(self, *, scaled: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = MLP(scaled=scaled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, scale_layer: int | None = None) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList(Block(scaled=index == scale_layer) for index in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def train(*, steps: int = 1, scale_layer: int | None = None) -> float:
    """``steps`` AdamW steps of a model built and fed here; the last loss."""
    model = GPT(scale_layer)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, VOCAB, (steps, BATCH, CONTEXT + 1))
    loss = torch.zeros(())
    for step in range(steps):
        optimiser.zero_grad()
        loss = model(tokens[step, :, :-1], tokens[step, :, 1:])
        loss.backward()
        optimiser.step()
    return float(loss.detach())


def main(path: str) -> None:
    import detctx

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with detctx.recording(path, portable_random=PORTABLE_SEED):
        train()


if __name__ == "__main__":
    main(sys.argv[1])
