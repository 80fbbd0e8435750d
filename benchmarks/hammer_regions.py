"""Hammer ``deterministic_region`` with threads and failing backward passes; print what was left on.

    python benchmarks/hammer_regions.py --rounds 20 --calls 50

- threads: 2 or 4 threads each call one region ``--calls`` times (forward
  only, or forward and backward), from a caller whose setting alternates
  between off and warn-only; counts rounds after which the flag is not the
  caller's setting;
- failures: a backward pass that raises inside the region (a custom autograd
  function, a tensor hook), ``--rounds`` times each; counts passes after which
  the flag is not the caller's setting.

The figures are those quoted in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import torch
from torch import nn

import detctx

Setting = tuple[bool, bool]
CALLERS: tuple[Setting, ...] = ((False, False), (True, True))


def flags() -> Setting:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def set_flags(setting: Setting) -> None:
    torch.use_deterministic_algorithms(setting[0], warn_only=setting[1])


def threads_round(threads: int, calls: int, backward: bool) -> None:
    region = detctx.deterministic_region(nn.Linear(8, 8))

    def work() -> None:
        for _ in range(calls):
            out = region(torch.randn(4, 8, requires_grad=backward))
            if backward:
                out.sum().backward()

    running = [threading.Thread(target=work) for _ in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()


class Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


def with_hook(t: torch.Tensor) -> torch.Tensor:
    middle = t * 2
    middle.register_hook(lambda grad: Fails.backward(None, grad))
    return middle * 3


PARTS = {
    "custom function": lambda t: Fails.apply(t * 2) * 3,
    "tensor hook": with_hook,
}


def failing_pass(part: str) -> None:
    region = detctx.deterministic_region(PARTS[part])
    try:
        region(torch.randn(3, requires_grad=True)).sum().backward()
    except RuntimeError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    print("| what | rounds | flag left other than the caller's |")
    print("| --- | --- | --- |")
    for threads in (2, 4):
        for backward in (False, True):
            left = 0
            for index in range(args.rounds):
                caller = CALLERS[index % 2]
                set_flags(caller)
                threads_round(threads, args.calls, backward)
                left += flags() != caller
            what = f"{threads} threads, {args.calls} calls each, " + (
                "forward+backward" if backward else "forward only"
            )
            print(f"| {what} | {args.rounds} | {left} |")
    for part in PARTS:
        left = 0
        for index in range(args.rounds):
            caller = CALLERS[index % 2]
            set_flags(caller)
            failing_pass(part)
            left += flags() != caller
        print(f"| a backward failing in a {part} | {args.rounds} | {left} |")


if __name__ == "__main__":
    main()
