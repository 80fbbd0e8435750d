"""CUDA, on a machine that has it; every test here is skipped without a CUDA device.

Run them all on a GPU machine (a few minutes at most):

    python -m pytest -m cuda -q -p no:cacheprovider

Every test runs in a fresh interpreter (``run_python`` or a subprocess): some
need CUDA untouched (lazy seeding, the cuBLAS warning), and none may wake CUDA
in the test process, where later tests expect it asleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import ROOT, run_python

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytestmark = needs_cuda


def test_every_cuda_device_is_seeded_in_the_block_and_continues_its_stream_after() -> None:
    out = run_python(
        """
        import torch, detctx

        def cuda_rand(device):
            return torch.rand(4, device=f"cuda:{device}").cpu()

        devices = range(torch.cuda.device_count())
        torch.manual_seed(5)
        for device in devices:
            cuda_rand(device)
        saved = [torch.cuda.get_rng_state(device) for device in devices]
        expected_after = {device: cuda_rand(device) for device in devices}  # the stream, unblocked
        for device, state in zip(devices, saved):
            torch.cuda.set_rng_state(state, device)

        with detctx.deterministic(seed=0) as seeding:
            assert "cuda" in seeding.sources
            inside = {device: cuda_rand(device) for device in devices}
        after = {device: cuda_rand(device) for device in devices}
        assert all(torch.equal(after[device], expected_after[device]) for device in devices)
        torch.cuda.manual_seed_all(0)
        assert all(torch.equal(inside[device], cuda_rand(device)) for device in devices)

        state = detctx.capture()                     # a snapshot holds every device's state
        assert len(state["cuda"]) == torch.cuda.device_count()
        first = {device: cuda_rand(device) for device in devices}
        state.restore()
        assert all(torch.equal(cuda_rand(device), first[device]) for device in devices)
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_an_unused_cuda_device_is_seeded_lazily_and_never_woken() -> None:
    out = run_python(
        """
        import torch, detctx

        torch.manual_seed(5)
        detctx.capture()
        detctx.fingerprint()
        with detctx.deterministic(seed=0) as seeding:
            torch.rand(3)
        assert "cuda" in seeding.sources and not torch.cuda.is_initialized()

        with detctx.deterministic(seed=0):
            inside = torch.rand(3, device="cuda").cpu()      # first use: inside the block
        after = torch.rand(3, device="cuda").cpu()
        torch.cuda.manual_seed_all(0)
        assert torch.equal(inside, torch.rand(3, device="cuda").cpu())
        torch.cuda.manual_seed_all(5)                        # the seed in force before
        assert torch.equal(after, torch.rand(3, device="cuda").cpu())
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_cublas_workspace_set_after_the_first_gemm_warns_that_it_is_too_late() -> None:
    out = run_python(
        """
        import warnings
        import torch, detctx

        a = torch.ones(8, 8, device="cuda")
        a @ a                                                # cuBLAS reads the variable here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with detctx.deterministic(seed=0):
                pass
        messages = [str(w.message) for w in caught if w.category is detctx.DeterminismWarning]
        assert any("CUBLAS_WORKSPACE_CONFIG" in m and "export" in m for m in messages), messages
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_entering_before_the_first_gemm_sets_cublas_workspace_without_a_warning() -> None:
    out = run_python(
        """
        import warnings
        import torch, detctx

        warnings.simplefilter("error", detctx.DeterminismWarning)
        with detctx.deterministic(seed=0):
            a = torch.ones(8, 8, device="cuda")
            a @ a
        print("ok")
        """
    )
    assert out.strip() == "ok"


TRAIN = """
import json
import torch, detctx
from torch import nn

def train():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Dropout(0.2), nn.Linear(32 * 8 * 8, 10),
    ).cuda()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(20):
        x = torch.randn(64, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        loss = nn.functional.cross_entropy(model(x), y)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]

runs = []
for _ in range(2):
    with detctx.deterministic(seed=1234):
        runs.append(train())
(l1, p1), (l2, p2) = runs
assert l1 == l2, (l1, l2)
assert all(torch.equal(a, b) for a, b in zip(p1, p2))
print(json.dumps(l1[-1]))
"""


def test_a_small_conv_net_trains_twice_bit_identical_with_determinism_on() -> None:
    out = run_python(TRAIN, timeout=300)
    assert float(out.strip().splitlines()[-1]) > 0


def test_a_region_covers_its_backward_on_cuda() -> None:
    out = run_python(
        """
        import torch, detctx

        seen = []

        class Record(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, tag):
                ctx.tag = tag
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                seen.append((ctx.tag, torch.are_deterministic_algorithms_enabled()))
                return grad, None

        part = torch.nn.Linear(64, 64).cuda()
        region = detctx.deterministic_region(lambda t: Record.apply(part(t), "inside"))
        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        Record.apply(region(Record.apply(x, "before")), "after").sum().backward()
        assert seen == [("after", False), ("inside", True), ("before", False)], seen
        assert not torch.are_deterministic_algorithms_enabled()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_doctor_probe_on_cuda_finds_every_op_identical_or_refused_with_determinism_on() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "detctx", "doctor", "--probe", "--device", "cuda", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert {row["device"] for row in rows} == {"cuda"} and len(rows) >= 16
    for row in rows:
        assert row["error"] is None, row
        assert row["identical_on"] or row["raises"], row


def test_the_benchmarks_fill_their_cuda_table(tmp_path: Any) -> None:
    rows = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/run_all.py", "--quick", "--only", "cuda", "--json", str(rows)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    scenario = json.loads(rows.read_text())["scenarios"]["cuda"]
    assert all(row["value"] is not None and row["value"]["median"] > 0 for row in scenario["rows"])
    [table] = scenario["tables"]
    assert [cells[1] for cells in table["rows"]] == ["initialised", "uninitialised"]
    assert all("-" not in cells[2:] for cells in table["rows"])
