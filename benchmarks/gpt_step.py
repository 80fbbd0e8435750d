"""A nanoGPT-style training step, the model ``locate_divergence`` is measured on.

Token and position embeddings, pre-norm blocks of ``nn.MultiheadAttention``
(causal, with dropout) and a GELU MLP, a tied-size head, cross-entropy, two
AdamW steps. :data:`SIZES` are the three sizes ``benchmarks/s10_locate_speed.py``
times; ``shakespeare`` is nanoGPT's ``train_shakespeare_char`` configuration.

    python -m benchmarks.gpt_step small     # as ``detctx run`` runs a training script
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn

VOCAB = 65
"""The characters of nanoGPT's shakespeare_char data set."""


class Size(NamedTuple):
    width: int
    layers: int
    context: int
    batch: int
    heads: int


SIZES = {
    "tiny": Size(64, 2, 32, 8, 2),
    "small": Size(256, 4, 128, 16, 4),
    "shakespeare": Size(384, 6, 256, 8, 6),
}


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(size.width)
        self.attn = nn.MultiheadAttention(size.width, size.heads, dropout=0.2, batch_first=True)
        self.norm2 = nn.LayerNorm(size.width)
        self.mlp = nn.Sequential(
            nn.Linear(size.width, 4 * size.width),
            nn.GELU(),
            nn.Linear(4 * size.width, size.width),
            nn.Dropout(0.2),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.size = size
        self.tokens = nn.Embedding(VOCAB, size.width)
        self.positions = nn.Embedding(size.context, size.width)
        self.drop = nn.Dropout(0.2)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        x = self.drop(self.tokens(idx) + self.positions(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def train_step(size: Size, steps: int = 2, device: str = "cpu") -> float:
    """Build the model (seeded by the caller), train ``steps`` AdamW steps; the last loss."""
    model = GPT(size).to(device)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.zeros(())
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (size.batch, size.context), device=device)
        targets = torch.randint(0, VOCAB, (size.batch, size.context), device=device)
        loss = model(idx, targets)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
    return float(loss.item())


def main(argv: list[str]) -> int:
    import detctx

    name = argv[0] if argv else "tiny"
    if name not in SIZES:
        print(f"unknown size {name!r}; choose from {', '.join(SIZES)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    # seed=None: $DETCTX_SEED, which ``detctx run`` sets to the same seed for every run.
    with detctx.deterministic(seed=None):
        loss = train_step(SIZES[name])
    print(f"loss: {loss:.8f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
