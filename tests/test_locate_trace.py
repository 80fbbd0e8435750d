"""Op traces on disk: streamed with a bounded buffer, read back as untrusted input."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import detctx
from detctx._locate.divergence import compare_traces
from detctx._locate.trace import BUFFER_BYTES, MAGIC, VERSION, OpRecord, TraceWriter, read_trace


def record(index: int, digest: int = 7, rng: int | None = None) -> OpRecord:
    return OpRecord(
        "aten::addmm",
        f"Net.layers.{index % 3}",
        f"train.py:{10 + index % 5}",
        "",
        "float32",
        (8, 32),
        "cpu",
        digest,
        rng,
    )


def write(path: Path, records: list[OpRecord]) -> Path:
    writer = TraceWriter(path)
    for item in records:
        writer.add(item)
    writer.close()
    return path


def test_records_come_back_as_written(tmp_path: Path):
    written = [record(i, digest=i * 3, rng=None if i % 2 else 2**64 - 1) for i in range(50)]
    assert list(read_trace(write(tmp_path / "a.trace", written))) == written


@pytest.mark.slow
def test_a_long_run_never_holds_more_of_its_trace_than_the_buffer(tmp_path: Path):
    # The bound is structural (the buffer is flushed at BUFFER_BYTES), so 2 * 10^5 ops
    # show what holds for 10^6 without a slow test.
    ops = 200_000
    writer = TraceWriter(tmp_path / "long.trace")
    largest = 0
    for index in range(ops):
        writer.add(record(index, digest=index))
        largest = max(largest, writer.buffered)
    writer.close()

    assert largest <= BUFFER_BYTES + 64
    size = (tmp_path / "long.trace").stat().st_size
    assert ops * 46 <= size < ops * 47
    assert sum(1 for _ in read_trace(tmp_path / "long.trace")) == ops


def test_two_traces_are_compared_record_by_record(tmp_path: Path):
    same = [record(i) for i in range(10)]
    a = write(tmp_path / "a.trace", same)
    assert compare_traces(a, write(tmp_path / "b.trace", same), 2) is None

    other = [*same[:6], record(6, digest=99), *same[7:]]
    found = compare_traces(a, write(tmp_path / "c.trace", other), 2)
    assert found is not None and (found.index, found.reason) == (6, "values")
    assert (found.module_path, found.source) == ("Net.layers.0", "train.py:11")
    assert found.mismatched is None and "not at hand" in str(found)

    shorter = compare_traces(a, write(tmp_path / "d.trace", same[:4]), 3)
    assert (
        shorter is not None and shorter.reason == "ended" and "run 3 ended after 4" in str(shorter)
    )


def header() -> bytes:
    return struct.pack("<8sH", MAGIC, VERSION)


def string(number: int, text: bytes) -> bytes:
    return b"S" + struct.pack("<IH", number, len(text)) + text


def op(ids: tuple[int, ...], flags: int = 0) -> bytes:
    return b"O" + struct.pack("<IIIIIQQQB", *ids, 1, 0, 0, flags)


GOOD_STRINGS = b"".join(
    string(i, text) for i, text in enumerate([b"aten::mul", b"", b"x.py:1", b"float32|2,3|cpu"])
)


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (b"", "the header is cut short"),
        (b"NOTATRACE\x00\x00", "wrong magic"),
        (struct.pack("<8sH", MAGIC, 9), "format version 9"),
        (header() + GOOD_STRINGS + op((0, 1, 2, 1, 3)), "record tag is cut short"),
        (header() + GOOD_STRINGS + op((0, 1, 2, 1, 3))[:20], "op record is cut short"),
        (header() + GOOD_STRINGS + op((0, 1, 2, 1, 9)), "unknown string"),
        (header() + GOOD_STRINGS + op((0, 1, 2, 1, 3), flags=4), "unknown string or flag"),
        (header() + string(1, b"a"), "out of order"),
        (header() + string(0, b"\xff\xfe"), "not UTF-8"),
        (header() + string(0, b"a") + op((0, 0, 0, 0, 0)), "malformed"),
        (header() + GOOD_STRINGS + b"E" + struct.pack("<Q", 5), "counts 5 ops"),
        (header() + b"E" + struct.pack("<Q", 0) + b"junk", "data follows"),
        (header() + b"Z", "unknown record tag"),
    ],
)
def test_a_crafted_or_damaged_trace_is_refused_with_where_and_why(
    tmp_path: Path, content: bytes, complaint: str
):
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    with pytest.raises(detctx.TraceError, match=complaint) as raised:
        list(read_trace(path))
    assert str(path) in str(raised.value) and "at byte" in str(raised.value)


def test_a_missing_trace_is_a_trace_error(tmp_path: Path):
    with pytest.raises(detctx.TraceError, match="cannot read op trace"):
        list(read_trace(tmp_path / "absent.trace"))


LOCATED_SCRIPT = """
import os, sys
import torch
from torch import nn

class Jitter(nn.Module):
    def forward(self, x):
        return x * (1 + int.from_bytes(os.urandom(4), "little") / 1e13)  # entropy line

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), Jitter(), nn.Linear(4, 1))
for step in range(2):
    loss = model(torch.ones(3, 4)).pow(2).mean()
    loss.backward()
    print(f"step {step} loss: {loss.item() if '--noisy' in sys.argv else 1.0}")
"""


def detctx_run(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detctx", "run", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow
def test_run_locate_names_the_op_module_and_line_where_two_processes_part(tmp_path: Path):
    (tmp_path / "train.py").write_text(textwrap.dedent(LOCATED_SCRIPT))

    done = detctx_run(
        "--locate", "--log-dir", "logs", "--", sys.executable, "train.py", cwd=tmp_path
    )

    assert done.returncode == 1, done.stderr
    assert "curves agree" in done.stdout or "AGREE" in done.stdout.upper()
    assert "op traces: Run 2 parted from run 1 at op" in done.stdout
    assert "aten::mul.Tensor in module Sequential.1 (train.py:8)" in done.stdout
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "run1.log",
        "run1.trace",
        "run2.log",
        "run2.trace",
    ]
    assert next(read_trace(tmp_path / "logs" / "run1.trace")).op.startswith("aten::")


@pytest.mark.slow
def test_run_locate_of_a_command_that_starts_no_python_says_so_and_exits_2(tmp_path: Path):
    done = detctx_run("--locate", "--", "sh", "-c", "echo loss: 1.0", cwd=tmp_path)

    assert done.returncode == 2
    assert "run 1 wrote no op trace" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_run_locate_of_agreeing_runs_exits_0_and_keeps_the_users_sitecustomize(tmp_path: Path):
    hidden = tmp_path / "site"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text('print("loss: 0.5 from the user sitecustomize")\n')
    (tmp_path / "train.py").write_text(
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "nn.Linear(3, 1)(torch.ones(2, 3)).sum().backward()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(hidden)}

    done = detctx_run("--locate", "--", sys.executable, "train.py", cwd=tmp_path, env=env)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "curves agree" in done.stdout
    assert "op traces: all 2 runs ran the same ops with the same bits." in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site", "train.py"]


@pytest.mark.slow
def test_run_locate_of_curves_that_differ_through_numpy_alone_says_where_the_difference_came_from(
    tmp_path: Path,
):
    (tmp_path / "train.py").write_text(
        "import numpy as np, torch\n"
        "weights = torch.ones(4) * 0.5\n"
        "noise = torch.from_numpy(np.random.default_rng().random(4)).clone()\n"
        "print('loss:', repr(float(weights.sum()) + float(noise.numpy().sum())))\n"
    )

    done = detctx_run("--locate", "--", sys.executable, "train.py", cwd=tmp_path)

    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "op traces: all 2 runs ran the same ops with the same bits, yet the metric curves "
        "differ: the difference came from outside torch ops" in done.stdout
    )


def test_runs_whose_first_random_op_differs_are_told_they_started_from_other_rng_states(
    tmp_path: Path,
) -> None:
    # An unseeded script, or a model built before the block: the ops before the first
    # draw agree, the first draw (the weights' init) comes from another generator state.
    plain = [record(i) for i in range(3)]
    a = write(tmp_path / "a.trace", [*plain, record(3, rng=11), record(4)])
    b = write(tmp_path / "b.trace", [*plain, record(3, rng=22), record(4)])

    found = compare_traces(a, b, 2)

    assert found is not None and found.reason == "rng" and found.first_draw
    text = str(found)
    assert "the first random op of the run, so the runs did not start from the same" in text
    order = ("(1) nothing seeds the run", "(2) the model or the data", "(3) something read")
    assert [text.index(cause) for cause in order] == sorted(text.index(c) for c in order)
    assert "another thread" not in text


def test_a_draw_that_differs_after_an_agreeing_one_points_at_a_draw_outside_the_recorded_ops(
    tmp_path: Path,
) -> None:
    a = write(tmp_path / "a.trace", [record(0, rng=5), record(1), record(2, rng=11)])
    b = write(tmp_path / "b.trace", [record(0, rng=5), record(1), record(2, rng=22)])

    found = compare_traces(a, b, 2)

    assert found is not None and found.reason == "rng" and not found.first_draw
    assert "something drew from it outside the recorded ops" in str(found)


@pytest.mark.slow
def test_run_locate_on_a_script_that_builds_its_model_before_the_block_gives_the_likely_causes(
    tmp_path: Path,
):
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """\
            import torch
            import detctx

            model = torch.nn.Linear(4, 1)          # built before the block: other weights
            with detctx.deterministic(seed=1234):
                print("step 0 loss:", repr(model(torch.ones(1, 4)).sum().item()))
            """
        )
    )

    done = detctx_run("--locate", "--", sys.executable, "train.py", cwd=tmp_path)

    assert done.returncode == 1, done.stderr
    assert "first divergence at point 1 of 1" in done.stdout
    # one diagnosis, the op traces': the curves' verdict adds no list of its own
    assert "1. nothing seeds the run" not in done.stdout
    assert "(1) nothing seeds the run" in done.stdout
    assert "aten::uniform_ at top level (train.py:4)" in done.stdout
    assert "the first random op of the run, so the runs did not start from the same" in done.stdout
    assert "another thread" not in done.stdout
