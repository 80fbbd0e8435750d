"""Portable random draws: a recording with ``portable_random`` draws every random op from
a generator keyed by its seed and the op, so two environments (torch releases, devices)
draw the same masks and the compare sees past them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import detctx
from detctx._basics import indexed_seed
from detctx._cli import main
from detctx._compare.reading import read_trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import across  # noqa: E402 (the example's folder first)

PORTABLE_SEED = 1234
DROPOUT = 0.2
TORCH_2_1_TRACE = Path(__file__).parent / "data" / "portable-random-torch-2.1.2.trace"
"""examples/across.py's step with dropout 0.2 (one step: its masks, SDPA's among them, and
its initial weights drawn inside the recording), recorded on torch 2.1.2 (CPU, one thread)
with ``portable_random=1234``.

Made again when the example or the trace format changes, from the project's folder, in an
environment with torch 2.1.2 and this detctx installed: ``python -c "import sys, torch;
sys.path.insert(0, 'examples'); import across, detctx; torch.set_num_threads(1);
ctx = detctx.recording('tests/data/portable-random-torch-2.1.2.trace', portable_random=1234);
ctx.__enter__(); across.train(steps=1, p=0.2); ctx.__exit__(None, None, None)"``.
"""
SCALE_LINE = next(
    number
    for number, line in enumerate(Path(across.__file__).read_text().splitlines(), start=1)
    if line.strip() == across.SCALE_LINE
)


def draws() -> list[torch.Tensor]:
    """One of each covered op, as a program calls them."""
    source = torch.ones(6, 8, requires_grad=True)
    return [
        torch.empty(1000).bernoulli_(0.3),
        torch.bernoulli(torch.full((50,), 0.5)),
        torch.rand(3, 4),
        torch.randn(5, dtype=torch.float64),
        torch.normal(0.0, 2.0, (7,)),
        torch.normal(torch.zeros(3), torch.ones(3)),
        torch.empty(4).uniform_(-2, 3),
        torch.empty(3).normal_(5, 2),
        torch.empty(4, dtype=torch.int64).random_(),
        torch.randint(0, 10, (6,)),
        torch.randint_like(torch.ones(3), 5),
        torch.randperm(9),
        torch.empty(3).exponential_(),
        torch.nn.functional.dropout(source, 0.5),
        torch.native_dropout(torch.ones(8), 0.5, True)[1],
        torch.rand_like(torch.ones(2, 2, dtype=torch.float16)),
        torch.randn(2, generator=torch.Generator().manual_seed(5)),
    ]


def recorded(path: Path, body: Callable[[], Any], portable_random: Any) -> Any:
    with detctx.recording(path, portable_random=portable_random):
        return body()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    return [torch.equal(x.detach(), y.detach()) for x, y in zip(a, b)]


def test_one_portable_seed_draws_the_same_whatever_torch_was_seeded_with(
    tmp_path: Path,
) -> None:
    torch.manual_seed(1)
    first = recorded(tmp_path / "a.trace", draws, 7)
    torch.manual_seed(2)
    second = recorded(tmp_path / "b.trace", draws, 7)
    other = recorded(tmp_path / "c.trace", draws, 8)
    assert all(same(first, second))
    assert not any(same(first, other)[:13])  # another seed, other draws (masks too)
    # torch's own generator was not advanced by any of them.
    torch.manual_seed(2)
    expected = torch.rand(4)
    torch.manual_seed(2)
    recorded(tmp_path / "d.trace", draws, 7)
    assert torch.equal(torch.rand(4), expected)


def test_true_keys_the_draws_by_torch_initial_seed_when_the_block_starts(
    tmp_path: Path,
) -> None:
    torch.manual_seed(5)
    keyed = recorded(tmp_path / "a.trace", draws, True)
    given = recorded(tmp_path / "b.trace", draws, 5)
    assert all(same(keyed, given))
    assert read_trace(tmp_path / "a.trace").header["environment"]["portable_random"] == 5


def test_a_bernoulli_mask_is_exact_and_its_words_are_pinned(tmp_path: Path) -> None:
    def masks() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(100_000).bernoulli_(0.3), torch.bernoulli(torch.full((64,), 0.3))

    first, elementwise = recorded(tmp_path / "a.trace", masks, 2**64 - 1)
    again = recorded(tmp_path / "b.trace", masks, 2**64 - 1)
    assert abs(float(first.mean()) - 0.3) < 0.005
    assert torch.equal(first, again[0]) and torch.equal(elementwise, again[1])
    # Word i of the n-th random op is SplitMix64 over (seed, n, i), a uniform its top 53
    # bits: the same definition on every machine and release, written out here.
    for op, mask in enumerate((first, elementwise)):
        key = indexed_seed(2**64 - 1, op)
        units = [(indexed_seed(key, i) >> 11) * 2.0**-53 for i in range(64)]
        assert mask[:64].tolist() == [float(u < 0.3) for u in units]


def test_factory_ops_honour_dtype_device_and_size(tmp_path: Path) -> None:
    def made() -> dict[str, torch.Tensor]:
        buffer = torch.empty(0)
        lasting = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        return {
            "rand": torch.rand(2, 3, dtype=torch.float64, device="cpu"),
            "half": torch.rand(4000, dtype=torch.float16),
            "bfloat": torch.randn(3, 5, dtype=torch.bfloat16),
            "randint": torch.randint(-3, 5, (400,), dtype=torch.int32),
            "randperm": torch.randperm(50, dtype=torch.int32),
            "uint8": torch.empty(500, dtype=torch.uint8).random_(),
            "out": torch.rand(7, out=buffer),
            "buffer": buffer,
            "like": torch.rand_like(lasting),
            "like_int": torch.randint_like(lasting, 3, 9, dtype=torch.int16),
            "normal": torch.normal(1.0, 0.5, (2, 2), dtype=torch.float64),
        }

    made_ = recorded(tmp_path / "a.trace", made, 3)
    assert made_["rand"].dtype == torch.float64 and made_["rand"].shape == (2, 3)
    assert made_["half"].dtype == torch.float16 and float(made_["half"].max()) < 1
    assert made_["bfloat"].dtype == torch.bfloat16 and made_["bfloat"].shape == (3, 5)
    assert made_["randint"].dtype == torch.int32
    assert -3 <= int(made_["randint"].min()) and int(made_["randint"].max()) < 5
    assert sorted(made_["randperm"].tolist()) == list(range(50))
    assert made_["randperm"].dtype == torch.int32
    assert made_["uint8"].dtype == torch.uint8 and int(made_["uint8"].max()) > 200
    assert made_["out"] is made_["buffer"] and made_["buffer"].shape == (7,)
    assert made_["like"].shape == (2, 3, 4, 5)
    assert made_["like"].is_contiguous(memory_format=torch.channels_last)
    like_int = made_["like_int"]
    assert like_int.dtype == torch.int16 and 3 <= int(like_int.min()) and int(like_int.max()) < 9
    assert made_["normal"].dtype == torch.float64 and made_["normal"].shape == (2, 2)


def test_in_place_ops_write_into_their_tensor_and_return_it(tmp_path: Path) -> None:
    def filled() -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = []
        for fill in (
            lambda t: t.bernoulli_(0.5),
            lambda t: t.normal_(),
            lambda t: t.uniform_(2, 3),
            lambda t: t.random_(0, 5),
            lambda t: t.exponential_(2.0),
        ):
            tensor = torch.zeros(16, 4)[:, 1]  # a strided view
            pairs.append((tensor, fill(tensor)))
        return pairs

    pairs = recorded(tmp_path / "a.trace", filled, 11)
    for tensor, result in pairs:
        assert result is tensor and bool((tensor != 0).any())
    uniform = pairs[2][0]
    assert float(uniform.min()) >= 2 and float(uniform.max()) < 3


def test_autograd_reads_the_portable_masks(tmp_path: Path) -> None:
    def dropped() -> tuple[torch.Tensor, ...]:
        x = torch.ones(64, requires_grad=True)
        y = torch.nn.functional.dropout(x, 0.25)
        y.sum().backward()
        z = torch.ones(64, requires_grad=True)
        output, mask = torch.native_dropout(z, 0.25, True)
        output.sum().backward()
        assert x.grad is not None and z.grad is not None
        return y.detach(), x.grad, output.detach(), mask, z.grad

    y, x_grad, output, mask, z_grad = recorded(tmp_path / "a.trace", dropped, 4)
    assert torch.equal(x_grad, y) and 0 < int((y == 0).sum()) < 64
    assert torch.equal(z_grad, mask.float() / 0.75) and torch.equal(output, z_grad)
    # CPU dropout (bernoulli_ below autograd) and native_dropout (CUDA's, NPU's) keep the
    # same elements when each is the first random op.
    fused = recorded(
        tmp_path / "b.trace", lambda: torch.native_dropout(torch.ones(64), 0.25, True), 4
    )
    assert torch.equal(fused[1], y != 0)


def small_step(path: Path, torch_seed: int, portable_random: Any) -> Path:
    """One AdamW step of a model with dropout, recorded: the model and data from seed 0,
    the step's draws from ``torch_seed`` (or the portable seed)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(16, 8)
    torch.manual_seed(torch_seed)
    with detctx.recording(path, portable_random=portable_random):
        optimiser.zero_grad()
        model(data).square().mean().backward()
        optimiser.step()
    return path


def compare(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    status = main(["compare", str(a), str(b), "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_a_dropout_step_with_two_torch_seeds_agrees_bit_for_bit_with_one_portable_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = small_step(tmp_path / "a.trace", 1, 99), small_step(tmp_path / "b.trace", 2, 99)
    status, result = compare(a, b, capsys)
    assert status == 0 and result["agree"] and result["bitwise"]
    assert result["environment_differences"] == {}


def test_without_portable_draws_two_torch_seeds_part_at_the_first_random_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = small_step(tmp_path / "a.trace", 1, None)
    b = small_step(tmp_path / "b.trace", 2, None)
    status, result = compare(a, b, capsys)
    assert status == 1
    origin = result["origin"]
    assert origin["op"] == "aten::bernoulli_.float" and origin["module_path"] == "Sequential.2"
    assert "detctx record --portable-random" in origin["difference"]
    assert result["bits_part"][0]["index"] == origin["index"] and result["bits_part"][0]["random"]


def test_two_portable_seeds_differ_at_the_first_random_op_and_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = small_step(tmp_path / "a.trace", 1, 5), small_step(tmp_path / "b.trace", 1, 6)
    status, result = compare(a, b, capsys)
    assert status == 1 and result["origin"]["op"] == "aten::bernoulli_.float"
    assert result["environment_differences"] == {"portable_random": [5, 6]}


def test_ops_torch_tags_random_run_where_their_arguments_draw_nothing(tmp_path: Path) -> None:
    # SDPA's CPU flash kernel is tagged nondeterministic_seeded (it could draw dropout);
    # without dropout it draws nothing and runs, as do dropout in eval and rrelu's.
    def body() -> torch.Tensor:
        q = torch.ones(1, 2, 4, 8)
        torch.nn.functional.rrelu(torch.ones(3), training=False)
        torch.nn.functional.dropout(torch.ones(3), 0.5, training=False)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    assert recorded(tmp_path / "a.trace", body, 1).shape == (1, 2, 4, 8)


def test_a_random_op_it_does_not_cover_is_refused_by_name_before_it_runs(tmp_path: Path) -> None:
    weights = torch.ones(5)
    state = torch.get_rng_state()
    with pytest.raises(detctx.TraceError, match=r"aten::multinomial .*without portable_random"):
        with detctx.recording(tmp_path / "a.trace", portable_random=1):
            torch.multinomial(weights, 2)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    assert torch.equal(weights, torch.ones(5))
    assert read_trace(tmp_path / "a.trace").outcome.startswith("raised TraceError")
    with pytest.raises(detctx.TraceError, match=r"aten::poisson"):
        recorded(tmp_path / "b.trace", lambda: torch.poisson(torch.ones(3)), 1)


_EXTENSION: list[Any] = []


def extension_dropout() -> Any:
    """A dropout op of an extension's own (as torch_npu has), which torch does not tag."""
    if not _EXTENSION:
        library = torch.library.Library("detctx_portable_tests", "DEF")
        library.define("own_dropout(Tensor x, float p) -> Tensor")
        library.impl(
            "own_dropout", lambda x, p: x * (torch.rand_like(x) >= p), "CompositeExplicitAutograd"
        )
        _EXTENSION[:] = [library, torch.ops.detctx_portable_tests.own_dropout]
    return _EXTENSION[1]


def test_an_extensions_own_dropout_is_refused_too(tmp_path: Path) -> None:
    own_dropout = extension_dropout()
    with pytest.raises(detctx.TraceError, match=r"detctx_portable_tests::own_dropout draws"):
        recorded(tmp_path / "a.trace", lambda: own_dropout(torch.ones(3), 0.5), 1)
    kept = recorded(tmp_path / "b.trace", lambda: own_dropout(torch.ones(3), 0.0), 1)
    assert torch.equal(kept, torch.ones(3))  # a probability of 0 draws nothing


@pytest.mark.parametrize("value", [1.0, -1, 2**64, "7", [7], np.float64(3), torch.tensor(3)])
def test_a_portable_seed_that_is_not_one_is_refused_before_anything_is_written(
    value: Any, tmp_path: Path
) -> None:
    target = tmp_path / "a.trace"
    target.write_bytes(b"earlier")
    with pytest.raises(detctx.TraceError, match=r"portable_random is None or False"):
        with detctx.recording(target, portable_random=value):
            pass
    assert target.read_bytes() == b"earlier"


def test_numpy_integers_and_false_are_taken(tmp_path: Path) -> None:
    with_numpy = recorded(tmp_path / "a.trace", lambda: torch.rand(3), np.uint64(2**64 - 1))
    assert torch.equal(with_numpy, recorded(tmp_path / "b.trace", lambda: torch.rand(3), 2**64 - 1))
    recorded(tmp_path / "c.trace", lambda: torch.rand(3), False)
    assert "portable_random" not in read_trace(tmp_path / "c.trace").header["environment"]


def test_ops_before_a_window_draw_portably_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps_counted: None
) -> None:
    def windowed(path: Path, torch_seed: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5))
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(torch_seed)
        with detctx.recording(path, steps="2:3", portable_random=3):
            for _ in range(3):  # steps 0 and 1 drop other elements without portable draws
                optimiser.zero_grad()
                model(torch.ones(4, 8)).sum().backward()
                optimiser.step()

    windowed(tmp_path / "a.trace", 1)
    windowed(tmp_path / "b.trace", 2)
    status, result = compare(tmp_path / "a.trace", tmp_path / "b.trace", capsys)
    assert status == 0 and result["bitwise"]


@pytest.mark.parametrize("scale_layer", [None, 0])
def test_a_trace_from_torch_2_1_with_the_same_portable_seed_compares_with_this_torch(
    scale_layer: int | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Dropout in every layer: without portable draws torch 2.1.2 and this torch part at the
    # first mask; with them the step agrees within tolerance, and a multiply added on this
    # side is still the origin across the two releases.
    torch.manual_seed(0)
    here = tmp_path / "here.trace"
    with detctx.recording(here, portable_random=PORTABLE_SEED):
        across.train(steps=1, p=DROPOUT, scale_layer=scale_layer)
    status, result = compare(TORCH_2_1_TRACE, here, capsys)
    releases = result["environment_differences"].get("torch", [torch.__version__])
    assert releases[0].startswith("2.1.2")
    assert "portable_random" not in result["environment_differences"]
    if scale_layer is None:
        assert status == 0 and result["agree"], result["past_tolerance"][:3]
    else:
        origin = result["origin"]
        assert status == 1 and origin["op"] == "aten::mul.Tensor"
        assert origin["module_path"] == "GPT.h.0.mlp"
        assert origin["source"].endswith(f"across.py:{SCALE_LINE}")


SCRIPT = """
import os, sys, torch
torch.manual_seed(int(sys.argv[1]))
print("variable", os.environ.get("DETCTX_RECORD_PORTABLE_RANDOM"))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5))
model(torch.randn(3, 4)).sum().backward()
"""


def detctx_record(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detctx", "record", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=ROOT,
    )


def test_detctx_record_portable_random_draws_the_same_in_two_torch_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runs = []
    for name, torch_seed, flag in (("a", "1", ["1234"]), ("b", "2", ["1234"]), ("c", "1", [])):
        path = tmp_path / f"{name}.trace"
        done = detctx_record(
            "-o",
            str(path),
            "--portable-random",
            *flag,
            "--",
            sys.executable,
            str(script),
            torch_seed,
        )
        assert done.returncode == 0, done.stderr
        assert "variable None" in done.stdout  # taken out of the recording process's env
        runs.append(path)
    assert read_trace(runs[0]).header["environment"]["portable_random"] == 1234
    status, result = compare(runs[0], runs[1], capsys)
    assert status == 0 and result["bitwise"]
    # The flag alone: keyed by torch.initial_seed() as the process starts, before the
    # script seeds torch (torch's default seed).
    alone = read_trace(runs[2]).header["environment"]["portable_random"]
    assert isinstance(alone, int) and alone != 1234


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", str(2**64), "0x10"])
def test_a_bad_portable_seed_on_the_command_line_exits_2_before_the_command_runs(
    value: str, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    done = detctx_record(
        "-o", str(tmp_path / "a.trace"), f"--portable-random={value}", "--", "touch", str(marker)
    )
    assert done.returncode == 2 and "--portable-random" in done.stderr
    assert "not valid" in done.stderr
    assert not marker.exists() and not (tmp_path / "a.trace").exists()


def test_a_bad_portable_seed_in_the_environment_leaves_the_process_unrecorded(
    tmp_path: Path,
) -> None:
    code = textwrap.dedent(
        """
        from detctx._compare import start_from_environment
        print("recording", start_from_environment())
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DETCTX_RECORD_DIR": str(tmp_path),
        "DETCTX_RECORD_PORTABLE_RANDOM": "12x",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "recording False" in done.stdout
    assert "not recording this process: $DETCTX_RECORD_PORTABLE_RANDOM='12x'" in done.stderr
    assert not (tmp_path / "main.trace").exists()
