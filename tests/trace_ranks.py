"""Data-parallel training of ``examples/across.py``'s model under torchrun (gloo): each rank's own
batch, gradients averaged with ``all_reduce``. ``--scale-rank R`` makes rank R's layer-1
MLP multiply by 1.003.

    torchrun --nproc-per-node 2 tests/trace_ranks.py [--scale-rank 1]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)
import across as trace_gpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale-rank", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = trace_gpt.GPT(1 if args.scale_rank == rank else None)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + rank)
    tokens = torch.randint(0, trace_gpt.VOCAB, (2, trace_gpt.BATCH, trace_gpt.CONTEXT + 1))
    for step in range(2):
        optimiser.zero_grad()
        loss = model(tokens[step, :, :-1], tokens[step, :, 1:])
        loss.backward()
        for parameter in model.parameters():
            assert parameter.grad is not None
            dist.all_reduce(parameter.grad)
            parameter.grad /= world
        optimiser.step()
    print(f"rank {rank} loss {float(loss.detach())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
