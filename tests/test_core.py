"""deterministic(seed=...): seeding, switches, exact restore, bad input."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import random
import threading
import warnings

import numpy as np
import pytest
import torch
from conftest import CounterSource
from helpers import draws, mindspeed_seed

import detctx
from detctx._basics.errors import DeterminismWarning, OutOfOrderExitError

# --- seeding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**32 - 1])
def test_draws_inside_a_block_match_mindspeed_seeding(seed: int) -> None:
    with detctx.deterministic(seed=seed) as run:
        inside = [draws() for _ in range(3)]
        normal = torch.randn(5)
    mindspeed_seed(seed)
    assert run.seed == seed
    assert inside == [draws() for _ in range(3)]
    assert torch.equal(normal, torch.randn(5))


def test_default_seed_is_1234() -> None:
    with detctx.deterministic() as run:
        inside = draws()
    mindspeed_seed(1234)
    assert run.seed == 1234 == detctx.DEFAULT_SEED
    assert inside == draws()


def test_numpy_integer_seed_is_accepted() -> None:
    with detctx.deterministic(seed=np.int64(7)) as run:
        inside = draws()
    mindspeed_seed(7)
    assert run.seed == 7 and isinstance(run.seed, int)
    assert inside == draws()


def test_seed_none_reads_detctx_seed_from_the_environment() -> None:
    os.environ["DETCTX_SEED"] = "42"
    with detctx.deterministic(seed=None) as run:
        inside = draws()
    mindspeed_seed(42)
    assert run.seed == 42
    assert inside == draws()


def test_seed_none_without_env_draws_a_fresh_seed_that_can_be_replayed() -> None:
    block = detctx.deterministic(seed=None)
    with block as first:
        first_draws = draws()
    with block as second:
        pass
    assert first.seed != second.seed  # 1 in 2**32 to collide
    with detctx.deterministic(seed=first.seed):
        assert draws() == first_draws


def test_entry_logs_one_info_line_with_the_seed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="detctx"), detctx.deterministic(seed=99):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "detctx"]
    assert len(lines) == 1
    assert "deterministic computing is applied" in lines[0]
    assert "seed=99" in lines[0] and "numpy" in lines[0] and "algorithms=on" in lines[0]


def test_seed_all_seeds_like_a_block_and_restores_nothing() -> None:
    run = detctx.seed_all(5)
    after_seed_all = draws()
    mindspeed_seed(5)
    assert run.seed == 5
    assert after_seed_all == draws()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["HCCL_DETERMINISTIC"] == "true"
    assert os.environ["PYTHONHASHSEED"] == "5"


# --- exact restore ------------------------------------------------------------------------------


def test_the_outer_stream_continues_as_if_the_block_never_ran() -> None:
    mindspeed_seed(3)
    before = draws()
    with detctx.deterministic(seed=0):
        draws()
        torch.randn(100)
    after = draws()
    mindspeed_seed(3)
    assert before == draws()
    assert after == draws()


def test_restores_after_an_exception() -> None:
    mindspeed_seed(3)
    with pytest.raises(ZeroDivisionError), detctx.deterministic(seed=0):
        draws()
        _ = 1 / 0
    after = draws()
    mindspeed_seed(3)
    assert after == draws()
    assert not torch.are_deterministic_algorithms_enabled()


def test_restores_after_keyboard_interrupt() -> None:
    mindspeed_seed(3)
    with pytest.raises(KeyboardInterrupt), detctx.deterministic(seed=0):
        draws()
        raise KeyboardInterrupt
    after = draws()
    mindspeed_seed(3)
    assert after == draws()


def test_restores_after_return_from_a_decorated_function() -> None:
    @detctx.deterministic(seed=0)
    def evaluate() -> tuple[object, ...]:
        return draws()

    mindspeed_seed(3)
    first = evaluate()
    after = draws()
    mindspeed_seed(3)
    assert after == draws()
    assert evaluate() == first
    assert evaluate.__name__ == "evaluate"


def test_nested_blocks_restore_to_the_enclosing_block() -> None:
    with detctx.deterministic(seed=1):
        outer_first = draws()
        with detctx.deterministic(seed=2):
            inner = draws()
        outer_second = draws()
    mindspeed_seed(1)
    assert outer_first == draws() and outer_second == draws()
    mindspeed_seed(2)
    assert inner == draws()


def test_one_object_can_be_reused_and_nested_in_itself() -> None:
    block = detctx.deterministic(seed=8)
    with block:
        a = draws()
        with block:
            b = draws()
        c = draws()
    with block:
        d = draws()
    mindspeed_seed(8)
    assert a == b == d == draws()
    assert c == draws()


def test_recursion_through_a_decorated_function() -> None:
    @detctx.deterministic(seed=4)
    def walk(depth: int) -> list[tuple[object, ...]]:
        here = draws()
        return [here] if depth == 0 else [here, *walk(depth - 1)]

    results = walk(3)
    assert len(set(results)) == 1  # each level starts from the same seeded state


def test_capture_and_restore_as_values() -> None:
    mindspeed_seed(11)
    state = detctx.capture()
    first = draws()
    state.restore()
    assert draws() == first
    assert set(state) >= {"python", "numpy", "torch"}


def test_fingerprint_equal_for_equal_states_and_different_otherwise() -> None:
    mindspeed_seed(11)
    a = detctx.fingerprint()
    mindspeed_seed(11)
    assert detctx.fingerprint() == a
    np.random.rand()
    assert detctx.fingerprint() != a
    assert len(a) == 16 and int(a, 16) >= 0


# --- switches -----------------------------------------------------------------------------------


def test_switches_are_on_inside_and_back_after() -> None:
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = False
    with detctx.deterministic(seed=0):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["HCCL_DETERMINISTIC"] == "true"
        assert os.environ["CLOSE_MATMUL_K_SHIFT"] == "1"
        assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
        assert os.environ["PYTHONHASHSEED"] == "0"
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    for name in ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "PYTHONHASHSEED"):
        assert name not in os.environ


def test_warn_option_maps_to_warn_only() -> None:
    torch.use_deterministic_algorithms(True)
    with detctx.deterministic(seed=0, algorithms="warn"):
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.skipif(
    importlib.util.find_spec("torch.utils.deterministic") is None,
    reason="this torch has no torch.utils.deterministic.fill_uninitialized_memory",
)
def test_fill_uninitialized_memory_is_restored() -> None:
    import torch.utils.deterministic as det

    det.fill_uninitialized_memory = False
    try:
        with detctx.deterministic(seed=0):
            det.fill_uninitialized_memory = True
        assert det.fill_uninitialized_memory is False
    finally:
        det.fill_uninitialized_memory = True


def test_each_switch_can_be_opted_out() -> None:
    with detctx.deterministic(
        seed=0,
        algorithms=False,
        cudnn=False,
        hash_seed=False,
        cublas_workspace=False,
        hccl=False,
        matmul_k_shift=False,
        flash_attention=False,
    ) as run:
        assert not torch.are_deterministic_algorithms_enabled()
        assert not any(name in os.environ for name in ("PYTHONHASHSEED", "HCCL_DETERMINISTIC"))
    assert run.switches == (
        "algorithms=off",
        "cudnn=off",
        "hash_seed=off",
        "cublas_workspace=off",
        "hccl=off",
        "matmul_k_shift=off",
        "flash_attention=off",
    )


def test_a_switch_turned_off_is_named_off_in_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="detctx"):
        with detctx.deterministic(seed=3, algorithms=False):
            pass

    (line,) = [r.getMessage() for r in caplog.records if "computing is applied" in r.getMessage()]
    assert "switches: algorithms=off, cudnn.deterministic=True" in line


def test_user_values_are_overwritten_and_restored() -> None:
    os.environ["PYTHONHASHSEED"] = "random"
    os.environ["HCCL_DETERMINISTIC"] = "1"  # not a value torch_npu understands
    with detctx.deterministic(seed=6):
        assert os.environ["PYTHONHASHSEED"] == "6"
        assert os.environ["HCCL_DETERMINISTIC"] == "true"
    assert os.environ["PYTHONHASHSEED"] == "random"
    assert os.environ["HCCL_DETERMINISTIC"] == "1"


def test_stronger_user_values_are_kept() -> None:
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    os.environ["HCCL_DETERMINISTIC"] = "strict"
    with detctx.deterministic(seed=0):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert os.environ["HCCL_DETERMINISTIC"] == "strict"
    with detctx.deterministic(seed=0, hccl="strict"):
        assert os.environ["HCCL_DETERMINISTIC"] == "strict"


def test_cublas_warns_when_cuda_is_already_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(DeterminismWarning, match="CUBLAS_WORKSPACE_CONFIG.*export"):
        with detctx.deterministic(seed=0, hccl=False):
            pass
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_no_cublas_warning_when_it_was_set_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        with detctx.deterministic(seed=0):
            pass


def test_hccl_warns_when_an_hccl_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "hccl")
    with pytest.warns(DeterminismWarning, match="HCCL_DETERMINISTIC.*before launch"):
        with detctx.deterministic(seed=0):
            pass


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [True, False, 1.0, "1234", [1], np.float32(3)])
def test_seeds_of_the_wrong_type_raise_type_error(seed: object) -> None:
    with pytest.raises(TypeError, match="seed must be an integer"):
        detctx.deterministic(seed=seed)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        detctx.seed_all(seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 2**32, 10**20])
def test_seeds_out_of_range_raise_value_error(seed: int) -> None:
    with pytest.raises(ValueError, match=r"\[0, 4294967295\]"):
        detctx.deterministic(seed=seed)


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("algorithms", "strict", ValueError),
        ("algorithms", 1, TypeError),
        ("cudnn", "yes", TypeError),
        ("cudnn", None, TypeError),
        ("hccl", "loose", ValueError),
        ("hash_seed", 0, TypeError),
    ],
)
def test_unknown_option_values_raise_at_construction(
    option: str, value: object, error: type[Exception]
) -> None:
    mindspeed_seed(2)
    with pytest.raises(error, match=option):
        detctx.deterministic(seed=0, **{option: value})  # type: ignore[arg-type]
    after = draws()
    mindspeed_seed(2)
    assert after == draws()
    assert not torch.are_deterministic_algorithms_enabled()


def test_unknown_option_name_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        detctx.deterministic(seed=0, benchmark=False)  # type: ignore[call-arg]


def test_bad_detctx_seed_raises_at_entry_and_changes_nothing() -> None:
    os.environ["DETCTX_SEED"] = "not-a-number"
    block = detctx.deterministic(seed=None)
    mindspeed_seed(2)
    with pytest.raises(ValueError, match="DETCTX_SEED"):
        with block:
            pass
    after = draws()
    mindspeed_seed(2)
    assert after == draws()
    assert "PYTHONHASHSEED" not in os.environ


# --- sources registry ---------------------------------------------------------------------------


def test_a_registered_torch_generator_is_seeded_and_restored() -> None:
    sampler = torch.Generator().manual_seed(77)
    detctx.register_source("sampler", sampler)
    try:
        before = sampler.get_state()
        with detctx.deterministic(seed=3) as run:
            inside = torch.randperm(10, generator=sampler)
        assert "sampler" in run.sources
        assert torch.equal(sampler.get_state(), before)
        assert torch.equal(inside, torch.randperm(10, generator=torch.Generator().manual_seed(3)))
    finally:
        detctx.unregister_source("sampler")


def test_registered_python_and_numpy_generators() -> None:
    rnd = random.Random(1)
    gen = np.random.default_rng(1)
    detctx.register_source("rnd", rnd)
    detctx.register_source("gen", gen)
    try:
        with detctx.deterministic(seed=5):
            inside = (rnd.random(), float(gen.random()))
        assert (rnd.random(), float(gen.random())) == (
            random.Random(1).random(),
            float(np.random.default_rng(1).random()),
        )
        assert inside == (
            random.Random(5).random(),
            float(np.random.Generator(np.random.PCG64(5)).random()),
        )
    finally:
        detctx.unregister_source("rnd")
        detctx.unregister_source("gen")


def test_a_custom_protocol_source() -> None:
    counter = CounterSource()
    counter.value = 100
    detctx.register_source("counter", counter)
    try:
        with detctx.deterministic(seed=9):
            assert counter.value == 9
            counter.value += 1
        assert counter.value == 100
    finally:
        detctx.unregister_source("counter")


def test_registry_errors() -> None:
    with pytest.raises(TypeError, match="capture"):
        detctx.register_source("bad", object())
    with pytest.raises(ValueError, match="already registered"):
        detctx.register_source("numpy", random.Random())
    with pytest.raises(ValueError, match="built-in"):
        detctx.unregister_source("torch")
    with pytest.raises(KeyError):
        detctx.unregister_source("never-registered")


# --- concurrency --------------------------------------------------------------------------------


def test_blocks_from_two_threads_are_serialised() -> None:
    inside_first = threading.Event()
    release_first = threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        with detctx.deterministic(seed=1):
            inside_first.set()
            release_first.wait(5)
            results["first"] = draws()

    def second() -> None:
        inside_first.wait(5)
        with detctx.deterministic(seed=2):
            results["second"] = draws()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside_first.wait(5)
    # The second thread must be waiting: it cannot have drawn while the first block is open.
    threads[1].join(0.2)
    assert "second" not in results
    release_first.set()
    for t in threads:
        t.join(10)
    mindspeed_seed(1)
    assert results["first"] == draws()
    mindspeed_seed(2)
    assert results["second"] == draws()


def test_overlapping_blocks_in_two_asyncio_tasks_raise_and_restore() -> None:
    mindspeed_seed(3)
    before = detctx.fingerprint()
    errors: list[BaseException] = []

    async def task(seed: int, hold: float) -> None:
        try:
            with detctx.deterministic(seed=seed):
                await asyncio.sleep(hold)
        except OutOfOrderExitError as exc:
            errors.append(exc)

    async def main() -> None:
        first = asyncio.create_task(task(1, 0.01))
        await asyncio.sleep(0)
        second = asyncio.create_task(task(2, 0.05))
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert len(errors) == 2
    assert "asyncio" in str(errors[0])
    assert detctx.fingerprint() == before
    assert not torch.are_deterministic_algorithms_enabled()


def test_exiting_a_block_that_was_never_entered_is_an_error() -> None:
    with pytest.raises(OutOfOrderExitError):
        detctx.deterministic(seed=0).__exit__(None, None, None)


def test_the_lock_is_released_after_a_failed_entry() -> None:
    os.environ["DETCTX_SEED"] = "-5"
    with pytest.raises(ValueError):
        with detctx.deterministic(seed=None):
            pass
    del os.environ["DETCTX_SEED"]
    done = threading.Event()

    def other() -> None:
        with detctx.deterministic(seed=1):
            done.set()

    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert done.is_set()


def test_a_thread_kept_waiting_is_told_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from detctx._state import transaction

    monkeypatch.setattr(transaction, "WAIT_BEFORE_WARNING_S", 0.05)
    caught: list[warnings.WarningMessage] = []
    entered = threading.Event()

    def worker() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with detctx.deterministic(seed=2):
                entered.set()
        caught.extend(seen)

    with detctx.deterministic(seed=1):
        thread = threading.Thread(target=worker, name="loader-thread")
        thread.start()
        assert not entered.wait(1.0)  # serialised: it cannot enter while this block is open
    thread.join(5)
    assert entered.is_set()
    messages = [str(w.message) for w in caught if w.category is DeterminismWarning]
    assert any("loader-thread has waited" in m and "deadlock" in m for m in messages), messages


def test_open_blocks_lists_what_each_open_block_applied_outermost_first() -> None:
    outside = detctx.open_blocks()  # blocks around the test (pytest --detctx-seed)
    with detctx.deterministic(seed=5), detctx.deterministic(seed=6, cudnn=False):
        inside = detctx.open_blocks()
    assert [seeding.seed for seeding in inside[len(outside) :]] == [5, 6]
    assert "algorithms=on" in inside[-1].switches
    assert "cudnn=off" in inside[-1].switches
    assert not any(switch.startswith("cudnn.") for switch in inside[-1].switches)
    assert detctx.open_blocks() == outside
