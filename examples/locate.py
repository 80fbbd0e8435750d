"""Find where two runs part: a model whose attention block mixes in OS entropy.

    python examples/locate.py            # in-process: locate_divergence
    detctx run --locate -- python examples/locate.py --train   # across processes
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import detctx


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1)
        # A "temperature" read from the OS: a different value in every process.
        temperature = 1.0 + int.from_bytes(os.urandom(4), "little") / 1e13
        return torch.softmax(scores / temperature, dim=-1) @ v


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = Attention(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean()


def train_step() -> None:
    model = Model()
    loss = model(torch.randn(2, 5, 16))
    loss.backward()
    print(f"loss: {loss.item():.8f}")


if __name__ == "__main__":
    if "--train" in sys.argv:
        detctx.seed_all(1234)
        train_step()
    else:
        print(detctx.locate_divergence(train_step))
