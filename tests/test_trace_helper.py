"""Where a CPU core is spare, a helper thread summarises large outputs from copies while the
program runs on: the trace is byte for byte the one recorded in line, whatever the program
does to an output after its op returned. Small outputs are summarised many at a time, with
or without the helper: each row and digest is the one the output has alone."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import detctx
import detctx._compare.recorder as recorder_module
import detctx._compare.summaries as summaries_module
from detctx._compare.reading import read_trace
from detctx._compare.sketch import IN_NUMPY, WIDENED, numpy_values, small_rows
from detctx._compare.stacked import staged_digests
from detctx._compare.summaries import SMALLEST_COPY, spare_core
from detctx._locate import PUBLIC_KEY, Staging, tensor_digest


def _helper(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(recorder_module, "spare_core", lambda: on)


def _program() -> None:
    """Large outputs, then writes into them that the recorded rows must not see."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(1024, 256)
    for _ in range(2):
        hidden = x * 2.0  # 1 MiB, and the model's hidden layer 4 MiB
        hidden.add_(1.0)  # an in-place op right after
        big = torch.randn(1024, 256)
        big.numpy()[:] = 0.0  # a write the dispatcher never sees
        loss = model(hidden + big).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _small_program() -> None:
    """Small outputs of every kind NumPy reads, and writes into them after their ops."""
    torch.manual_seed(4)
    x = torch.randn(8, 6)
    for step in range(3):
        y = x.t() * 2.0  # a transposed result
        y.add_(1.0)
        z = torch.complex(y, -y).conj() * 1j
        flags = y > 0.5
        counts = flags.sum(dim=0)
        half = (y * 0.25).half()
        scalar = (y * z.real).sum()
        brain = (y * 0.5).bfloat16() * 3.0  # a dtype NumPy has not: float32 values, own bits
        eight = (y * 0.125).to(torch.float8_e4m3fn)
        y.numpy()[:] = float(step)  # behind torch's back
        empty = y[:0] * 3.0
        x = x + torch.where(flags.t(), half.float().t(), scalar) + counts.sum() + empty.sum()
        x = x + brain.float().t() + eight.float().t()


def _helper_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "detctx-summaries"]


@pytest.mark.parametrize("pending", [summaries_module.PENDING_BYTES, 1])
def test_a_trace_recorded_with_the_helper_is_byte_for_byte_the_one_recorded_in_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pending: int
) -> None:
    monkeypatch.setattr(summaries_module, "PENDING_BYTES", pending)
    monkeypatch.setenv("DETCTX_RECORD_RUN", "one-run")  # the header's run identity, the same
    _helper(monkeypatch, False)
    with detctx.recording(tmp_path / "in-line.trace"):
        _program()
    _helper(monkeypatch, True)
    with detctx.recording(tmp_path / "helper.trace"):
        _program()
        assert _helper_threads(), "the helper runs while recording"
    assert not _helper_threads()
    in_line = (tmp_path / "in-line.trace").read_bytes()
    assert (tmp_path / "helper.trace").read_bytes() == in_line
    values = read_trace(tmp_path / "helper.trace").values
    assert (values["stats"][:, 0] * 4 >= SMALLEST_COPY).sum() > 10  # the helper had work


@pytest.mark.parametrize(("helper", "batch_ops"), [(False, 1), (False, 5), (True, 64)])
def test_small_outputs_summarised_together_get_the_rows_and_digests_they_have_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper: bool, batch_ops: int
) -> None:
    monkeypatch.setenv("DETCTX_RECORD_RUN", "one-run")  # the header's run identity, the same

    def recorded(name: str, batch: int, with_helper: bool) -> bytes:
        monkeypatch.setattr(summaries_module, "BATCH_OPS", batch)
        _helper(monkeypatch, with_helper)
        with detctx.recording(tmp_path / name):
            _small_program()
        return (tmp_path / name).read_bytes()

    together = recorded("a.trace", batch_ops, helper)
    assert together == recorded("b.trace", 1, False)  # each op's outputs alone
    trace = read_trace(tmp_path / "a.trace")
    dtypes = {trace.text(number) for number in trace.values["dtype"]}
    assert {"float32", "complex64", "bool", "int64", "float16", "bfloat16"} <= dtypes
    assert "float8_e4m3fn" in dtypes


def test_a_small_output_row_and_digest_are_those_of_the_tensor_itself() -> None:
    torch.manual_seed(5)
    tensors = [
        torch.randn(3, 5).t(),
        torch.randn(700),  # past the 2 KiB a digest sums directly
        torch.randn(2, 3, dtype=torch.complex64).conj(),
        torch.tensor(True),
        torch.arange(9).reshape(3, 3)[:, 1],
        torch.randn(IN_NUMPY, dtype=torch.float64),  # 64 KiB
        torch.randn(4).half(),
        torch.randn(3, 7).bfloat16().t(),  # NumPy has not the dtype: its float32 values
        (torch.randn(50) * 4).to(torch.float8_e5m2),
    ] * 40  # more than one staging buffer's rows: the digests are taken in parts
    arrays = [numpy_values(tensor) for tensor in tensors]
    assert all(array is not None for array in arrays)
    kept = [array for array in arrays if array is not None]
    # A dtype NumPy has not is digested from its own bits (a copy), as the summaries do.
    bits = [
        tensor.clone() if tensor.dtype in WIDENED else array
        for tensor, array in zip(tensors, kept)
    ]
    digests = staged_digests(Staging(key=PUBLIC_KEY), bits)
    assert digests == [tensor_digest(tensor, key=PUBLIC_KEY) for tensor in tensors]
    rows = small_rows(kept)
    for tensor, row in zip(tensors, rows):
        values = torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor
        values = values.double()
        assert row[0] == values.numel()
        assert row[3] == values.min() and row[4] == values.max()
        assert np.isclose(row[6], float(values.norm()), rtol=1e-12)
        assert np.isclose(row[5], float(values.mean()), rtol=1e-9, atol=1e-12)


def test_whether_to_run_a_helper_is_decided_at_the_first_op_not_when_recording_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `detctx record` starts recording before the program sets torch's thread count.
    threads = {"torch": 2}
    monkeypatch.setattr(recorder_module, "spare_core", lambda: threads["torch"] < 2)
    with detctx.recording(tmp_path / "a.trace"):
        threads["torch"] = 1  # torch.set_num_threads(1), as the program's first line
        torch.randn(512, 512) * 2.0
        assert _helper_threads()
    assert not _helper_threads()


def test_the_helper_summarises_an_output_as_it_was_when_its_op_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _helper(monkeypatch, True)
    x = torch.randn(1024, 1024)
    with detctx.recording(tmp_path / "a.trace"):
        y = x * 3.0
        y.numpy()[:] = float("nan")  # behind torch's back, at once
        y.mul_(0.0)
    trace = read_trace(tmp_path / "a.trace")
    names = [trace.text(number) for number in trace.ops["op"]]
    row = trace.values["stats"][names.index("aten::mul.Tensor")]
    assert row[1] == 0  # no NaN: the values the multiply made
    assert np.isclose(row[6], float((x * 3.0).norm()), rtol=1e-5)
    assert np.isclose(row[3], float((x * 3.0).min())) and np.isclose(row[4], float((x * 3.0).max()))


@pytest.mark.parametrize("helper", [True, False])
def test_a_failing_summary_stops_the_program_and_leaves_the_trace_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper: bool
) -> None:
    _helper(monkeypatch, helper)

    def broken(*_: object, **__: object) -> None:
        raise MemoryError("no room for the sketch")

    monkeypatch.setattr(summaries_module, "statistics", broken)
    monkeypatch.setattr(summaries_module, "copy_summaries", broken)  # large ones, together
    x = torch.randn(512, 512)
    with pytest.raises(RuntimeError, match="summarising a recorded op failed") as raised:
        with detctx.recording(tmp_path / "a.trace"):
            for _ in range(20):
                x = x * 1.5
    assert isinstance(raised.value.__cause__, MemoryError)
    assert not _helper_threads()
    with pytest.raises(detctx.TraceError, match=r"a\.trace: cut short"):
        read_trace(tmp_path / "a.trace")


@pytest.mark.parametrize("helper", [True, False])
def test_dataloader_workers_start_while_the_helper_has_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper: bool
) -> None:
    _helper(monkeypatch, helper)
    data = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(16, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
    x = torch.randn(512, 512)
    with detctx.recording(tmp_path / "a.trace"):
        for _ in range(3):
            for (batch,) in loader:  # each epoch forks two workers
                x = x * 1.0001 + batch.sum()
    trace = read_trace(tmp_path / "a.trace")
    assert len(trace) >= 3 * 4 * 2


@pytest.mark.parametrize(
    ("ranks", "threads", "cores", "spare"),
    [
        ("1", 1, 2, True),
        ("1", 2, 2, False),
        ("2", 3, 8, True),
        ("3", 3, 8, False),
        ("0", 1, 8, False),
        ("-1", 1, 8, False),
        ("two", 1, 8, False),
        ("1e3", 1, 8, False),
        ("", 1, 8, False),
    ],
)
def test_a_helper_runs_only_where_every_local_rank_has_a_core_to_spare(
    monkeypatch: pytest.MonkeyPatch, ranks: str, threads: int, cores: int, spare: bool
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(
        summaries_module.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False
    )
    assert spare_core() is spare


def test_an_interrupt_while_the_helper_finishes_leaves_the_trace_cut_short_not_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _helper(monkeypatch, True)
    interrupted = False

    def join_once(thread: threading.Thread, timeout: float | None = None) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            raise KeyboardInterrupt  # as a Ctrl-C arriving during the join
        original_join(thread, timeout)

    original_join = threading.Thread.join
    x = torch.randn(512, 512)
    with pytest.raises(KeyboardInterrupt):
        with detctx.recording(tmp_path / "a.trace"):
            monkeypatch.setattr(threading.Thread, "join", join_once)
            for _ in range(50):
                x = x * 1.0001
    monkeypatch.undo()
    assert not _helper_threads()
    with pytest.raises(detctx.TraceError, match="cut short"):
        read_trace(tmp_path / "a.trace")


@pytest.mark.parametrize("helper", [True, False])
def test_a_summary_failing_in_the_programs_thread_leaves_no_op_missing_unseen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper: bool
) -> None:
    # The program catches the error and runs on: the trace must not read as complete.
    _helper(monkeypatch, helper)
    calls = 0

    def fails_once(tensor: torch.Tensor) -> np.ndarray | None:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise MemoryError("no room for the copy")
        return numpy_values(tensor)

    monkeypatch.setattr(summaries_module, "numpy_values", fails_once)
    x = torch.randn(512, 512)
    failures = 0
    with pytest.raises(RuntimeError, match="summarising a recorded op failed"):
        with detctx.recording(tmp_path / "a.trace"):
            for _ in range(10):
                try:
                    x = x * 1.5 + torch.ones(3).sum()
                except RuntimeError:
                    failures += 1
    assert failures >= 1
    assert not _helper_threads()
    with pytest.raises(detctx.TraceError, match="cut short"):
        read_trace(tmp_path / "a.trace")


def test_large_float32_outputs_summarised_together_get_the_rows_they_have_alone() -> None:
    # The helper measures outputs of one size in one stacked product; each row must be
    # the one that output gets by itself, whatever it is stacked with.
    from detctx._compare.sketch import IN_NUMPY
    from detctx._compare.stacked import float_rows, statistics

    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(count, generator=generator) * scale
        for count in (IN_NUMPY + 1, 2 * IN_NUMPY, 40_000)
        for scale in (1e-3, 1.0, 1e3, 1e12)
    ]
    tensors.append(torch.full((IN_NUMPY + 7,), 0.0))
    tensors.append(torch.randn(40_000, generator=generator).relu())  # half of it zeros
    tensors.append(
        torch.randn(40_000, generator=generator).masked_fill(
            torch.arange(40_000) == 3, float("nan")
        )
    )
    rows = float_rows(tensors)
    for tensor, row in zip(tensors, rows):
        alone = statistics(tensor)
        assert alone is not None
        if row is None:  # values past 2**40, NaN: statistics scales or counts them itself
            assert alone[1] > 0 or abs(alone[4]) > 2.0**40 or abs(alone[3]) > 2.0**40
            continue
        assert np.array_equal(row, alone)
        assert np.array_equal(row, float_rows([tensor])[0])
    assert sum(row is not None for row in rows) >= 10


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([0.0, -0.0, 1.0, float("nan"), float("inf"), 0.0]),  # NumPy, in rows
        torch.tensor([0.0, 3.0, -0.0, 5e-324], dtype=torch.float64),  # scaled: 5e-324 stays
        torch.randn(40_000).relu(),  # float32, stacked
        torch.randn(40_000).relu().masked_fill(torch.arange(40_000) % 7 == 0, float("nan")),
        torch.randn(40_000).relu().double() * 1e300,  # float64, scaled before it is measured
        torch.randn(40_000).relu().half(),  # measured as float32
        torch.randint(0, 3, (40_000,)),  # measured as float64
    ],
)
def test_the_count_of_zeros_is_of_the_values_themselves_on_every_path(
    tensor: torch.Tensor,
) -> None:
    # A ReLU mask that passes an element in one run and stops it in the other changes its
    # count of zeros: counted on the values as they are, never on NaN or Inf set to zero,
    # a scaled copy or a padded one.
    from detctx._compare.stacked import statistics

    row = statistics(tensor)
    assert row is not None
    assert row[7] == int((tensor == 0).sum()) > 0


def test_large_outputs_copies_digested_together_get_the_digests_they_have_alone() -> None:
    torch.manual_seed(6)
    tensors = [
        torch.randn(IN_NUMPY + 1),
        torch.randn(64, 1024, dtype=torch.float64),  # 512 KiB: the largest a buffer takes
        torch.randint(0, 9, (30_000,)),
        torch.randn(40_000).bfloat16(),
        torch.randn(5000, dtype=torch.complex64),
    ] * 12  # more than one buffer's rows
    copies = [tensor.clone() for tensor in tensors]
    assert staged_digests(Staging(key=PUBLIC_KEY), copies) == [
        tensor_digest(tensor, key=PUBLIC_KEY) for tensor in tensors
    ]


def _odd_bits(count: int, generator: torch.Generator) -> torch.Tensor:
    """float32 numbers whose bits a copy through arithmetic could change: NaNs with payloads
    and signs (quiet and signalling), -0.0, infinities, subnormals, among ordinary values."""
    values = torch.randn(count, generator=generator)
    bits = values.view(torch.int32)
    odd = torch.tensor(
        [0x7FC00001, 0x7F800001, -0x00400001, -0x80000000, 0x7F800000, 0x00000001],
        dtype=torch.int32,
    )
    at = torch.randint(0, count, (len(odd),), generator=generator)
    bits[at] = odd
    return values


def test_copies_digested_from_the_stack_of_their_rows_get_the_digests_they_have_alone() -> None:
    # Float32 copies of one size whose bytes are whole rows of the digest's reduce step
    # are digested from the stack their rows are measured in; every other copy in the
    # staging buffer or alone. Each digest and row must be the one the copy has alone,
    # odd bits included, whatever it is stacked with.
    from detctx._compare.stacked import copy_summaries, float_rows
    from detctx._locate import ROW_BYTES, SMALL, STAGED

    generator = torch.Generator().manual_seed(8)
    whole = ROW_BYTES // 4  # numbers in one row of the reduce step
    tensors = [
        _odd_bits(count, generator).reshape(shape)
        for count, shape in (
            (5 * whole, (5, whole)),  # whole rows: from the stack
            (5 * whole, (whole, 5)),  # the same size, another shape
            (8 * whole, (8 * whole,)),
            (STAGED // 4, (STAGED // 4,)),  # the largest one reduce step takes
            (5 * whole + 5, (5 * whole + 5,)),  # not whole rows: in the staging buffer
            (STAGED // 4 + whole, (STAGED // 4 + whole,)),  # past one reduce step: alone
        )
        for _ in range(3)
    ]
    tensors.insert(4, torch.randn(5 * whole, generator=generator) * 3)  # NaN-free: a row
    tensors.append(torch.randint(0, 9, (whole,), dtype=torch.int64))  # another dtype
    tensors.append(torch.randn(4 * whole, dtype=torch.float64, generator=generator))
    assert IN_NUMPY < 5 * whole and SMALL < 5 * ROW_BYTES <= STAGED
    copies = [tensor.clone() for tensor in tensors]
    staging = Staging(key=PUBLIC_KEY)
    rows, digests = copy_summaries(staging, copies)
    assert len(staging) == 0  # left empty
    assert digests == [tensor_digest(tensor, key=PUBLIC_KEY) for tensor in tensors]
    for row, alone in zip(rows, float_rows([tensor.clone() for tensor in tensors])):
        assert (row is None) == (alone is None)
        if row is not None and alone is not None:
            assert np.array_equal(row, alone)
    assert sum(row is not None for row in rows) >= 1
    for copy, tensor in zip(copies, tensors):  # read, never written
        assert copy.view(torch.uint8).equal(tensor.view(torch.uint8))


@pytest.mark.parametrize(
    ("shape", "shapes"),
    [
        ((2, 1000), [(1000,), (1000,)]),  # not whole rows
        ((2, 256), [(256,), (256,)]),  # at most SMALL bytes: no reduce step
        ((2, 2 * 131_072), [(262_144,), (262_144,)]),  # two reduce steps
        ((2, 2048), [(2048,)]),  # a shape short
        ((4096,), [(4096,)]),  # not a stack of rows
        ((0, 2048), [(2048,)]),  # no rows, a shape
    ],
)
def test_stacked_digests_refuse_what_one_reduce_step_does_not_make_alone(
    shape: tuple[int, int], shapes: list[tuple[int, ...]]
) -> None:
    from detctx._locate import stacked_digests

    with pytest.raises(ValueError, match="whole rows of one reduce step"):
        stacked_digests(torch.zeros(shape), shapes, PUBLIC_KEY)
    assert stacked_digests(torch.zeros(0, 2048), [], PUBLIC_KEY) == []


def test_outputs_with_infinities_of_both_signs_are_summarised_without_a_warning(
    tmp_path: Path,
) -> None:
    # +Inf and -Inf in one output make NaN in its batched sums (the row is then measured
    # alone); NumPy must not warn of it at the program's line.
    from detctx._compare.stacked import float_rows

    values = torch.randn(1 << 18)
    values[0], values[1] = float("inf"), float("-inf")  # one in each of two columns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float_rows([values], own=False) == [None]
        assert float_rows([values.clone(), values.clone()], own=True) == [None, None]
        with detctx.recording(tmp_path / "a.trace"):
            (values * 2.0).sum()
    row = read_trace(tmp_path / "a.trace").values["stats"][0]
    assert row[2] == 2  # both counted


def test_a_recorded_bfloat16_output_keeps_the_digest_of_its_own_bits(tmp_path: Path) -> None:
    # Its row is made from its float32 values (the same numbers), its digest from its bits:
    # the digest locate and another device give the same tensor.
    torch.manual_seed(8)
    x = torch.randn(6, 5, dtype=torch.bfloat16)
    with detctx.recording(tmp_path / "a.trace"):
        tripled = x * 3.0
        made = [tripled, tripled.exp(), x.t() * x.t()]
    trace = read_trace(tmp_path / "a.trace")
    values = trace.values
    assert [trace.text(number) for number in values["dtype"]] == ["bfloat16"] * 3
    for tensor, row in zip(made, values):
        bits = (int(row["high"]) << 64) | int(row["low"])
        assert bits == tensor_digest(tensor, key=PUBLIC_KEY)
        numbers = tensor.double()
        assert row["stats"][0] == 30 and row["stats"][3] == numbers.min()
        assert np.isclose(row["stats"][6], float(numbers.norm()), rtol=1e-12)


def test_an_output_too_large_for_numpys_rows_is_copied_not_summarised_alone_in_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40 KiB of float32: past IN_NUMPY numbers, below the 64 KiB copies once started at.
    alone: list[torch.Size] = []
    compute = summaries_module._Output.compute

    def computed(self: object, tensor: torch.Tensor) -> None:
        alone.append(tensor.shape)
        compute(self, tensor)  # type: ignore[arg-type]

    monkeypatch.setattr(summaries_module._Output, "compute", computed)
    x = torch.randn(10_000)
    with detctx.recording(tmp_path / "a.trace"):
        flags = x > 0
        tripled = x * 3.0
        made = [flags, tripled, x * 2.0, flags.logical_not(), tripled.bfloat16()]  # in order
    assert alone == []
    trace = read_trace(tmp_path / "a.trace")
    assert len(trace.values) == len(made)
    for tensor, row in zip(made, trace.values):
        assert (int(row["high"]) << 64) | int(row["low"]) == tensor_digest(tensor, key=PUBLIC_KEY)
        assert row["stats"][0] == 10_000
