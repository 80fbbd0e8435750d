"""A nanoGPT-style training step, recorded in two environments and compared (docs/proving.md,
"Across environments").

Token and position embeddings, pre-norm blocks of causal self-attention
(``F.scaled_dot_product_attention``) and a GELU MLP, a head, cross-entropy,
AdamW. ``--sdpa math`` runs every attention through SDPA's math kernel (a
CPU's default is its flash kernel); ``--scale-layer N`` multiplies layer N's
MLP activations by 1.003, the change to be found; ``--dropout P`` turns
dropout on (after the embeddings, in the attention through SDPA's
``dropout_p``, after each attention and each MLP), whose masks two torch
releases or devices draw alike only with ``--portable-random``. ``--demo``
records the step with the flash kernel and again with the math kernel and the
multiply, and prints what ``detctx compare`` prints for the two traces.

    detctx record -o a.trace -- python examples/across.py
    detctx record -o b.trace -- python examples/across.py --sdpa math --scale-layer 1
    detctx compare a.trace b.trace
    detctx record --portable-random 1234 -o c.trace -- python examples/across.py --dropout 0.2
    python examples/across.py --demo
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, LAYERS, HEADS, CONTEXT, BATCH, VOCAB = 64, 2, 4, 32, 4, 65
SCALE_LINE = "x = x * 1.003"


def dropout(p: float) -> nn.Module:
    """Dropout of ``p``; none at all (no op) for 0."""
    return nn.Dropout(p) if p else nn.Identity()


class Attention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.resid_dropout = dropout(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, *, scaled: bool, p: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = dropout(p)
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))
        if self.scaled:
            x = x * 1.003
        return self.dropout(self.c_proj(x))


class Block(nn.Module):
    def __init__(self, *, scaled: bool, p: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention(p)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = MLP(scaled=scaled, p=p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, scale_layer: int | None = None, p: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.drop = dropout(p)
        self.h = nn.ModuleList(Block(scaled=index == scale_layer, p=p) for index in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


@contextlib.contextmanager
def sdpa(kernel: str) -> Iterator[None]:
    """SDPA's math kernel for ``"math"``, torch's choice (flash on a CPU) otherwise."""
    if kernel != "math":
        yield
        return
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch before 2.3
        with torch.backends.cuda.sdp_kernel(enable_flash=False, enable_mem_efficient=False):
            yield
        return
    with sdpa_kernel(SDPBackend.MATH):
        yield


def train(
    *, steps: int = 2, kernel: str = "flash", scale_layer: int | None = None, p: float = 0.0
) -> float:
    """``steps`` AdamW steps from seed 0, dropout ``p``; the last loss."""
    torch.manual_seed(0)
    model = GPT(scale_layer, p)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, VOCAB, (steps, BATCH, CONTEXT + 1))
    loss = torch.zeros(())
    with sdpa(kernel):
        for step in range(steps):
            optimiser.zero_grad()
            loss = model(tokens[step, :, :-1], tokens[step, :, 1:])
            loss.backward()
            optimiser.step()
    return float(loss.detach())


def demo() -> None:
    import tempfile
    from pathlib import Path

    import detctx

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        a, b = Path(folder, "a.trace"), Path(folder, "b.trace")
        with detctx.recording(a):
            train()
        with detctx.recording(b):
            train(kernel="math", scale_layer=1)
        print(detctx.compare_traces(a, b).format(shown=4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sdpa", default="flash", choices=["flash", "math"])
    parser.add_argument("--scale-layer", type=int)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--demo", action="store_true")
    args = parser.parse_args()
    if args.demo:
        demo()
        return
    loss = train(steps=args.steps, kernel=args.sdpa, scale_layer=args.scale_layer, p=args.dropout)
    print(f"loss {loss}")


if __name__ == "__main__":
    main()
