"""Megatron's tensor-parallel RNG tracker inside detctx blocks.

Megatron's real tracker code runs on the simulated NPU in subprocesses, reached
through ``torch.cuda`` as MindSpeed reaches the NPU (``tests/megatron_on_npu.py``);
the tests marked ``cuda`` run it on a CUDA device where there is one.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import launch_ranks, run_python

import detctx
from detctx import SeedMismatchError, distributed_deterministic
from detctx.distributed import MegatronSeeds
from detctx.distributed._agreement import decide
from detctx.distributed._rank_check import compare_rows, verification_row
from detctx.integrations.megatron import TrackerSource, register_tracker, tracker_seeds

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

# Every child: the simulated NPU behind torch.cuda, Megatron's tracker module as
# `tracker_module`, and detctx's read-once-switch warnings (about a device that is
# only simulated) silenced.
ON_NPU = """
import random, warnings
import megatron_on_npu
from megatron_on_npu import draw
tracker_module = megatron_on_npu.install()
import numpy as np, torch, detctx
from detctx.integrations import megatron as detctx_megatron
warnings.simplefilter("ignore", detctx.DeterminismWarning)
"""


def run_on_npu(code: str) -> str:
    return run_python(ON_NPU + textwrap.dedent(code), timeout=240)


# --- seeding the Megatron way ----------------------------------------------------------------


@pytest.mark.slow
def test_a_block_seeds_the_tracker_exactly_as_megatron_does_for_each_rank_layout() -> None:
    out = run_on_npu(
        """
        from detctx.distributed import MegatronSeeds

        def megatron_set_random_seed(seed_, tp, ep, etp, pp, dp=None):
            # megatron.training.initialize._set_random_seed, for these ranks.
            seed = seed_ + 100 * pp + (0 if dp is None else 10 * dp)
            random.seed(seed); np.random.seed(seed); torch.manual_seed(seed)
            tracker_module.model_parallel_cuda_manual_seed(
                seed, tp_rank=tp, ep_rank=ep, etp_rank=etp, force_reset_rng=True
            )

        def observe():
            tracker = tracker_module.get_cuda_rng_tracker()
            seen = {"cpu": [random.random(), float(np.random.rand()), torch.rand(2).tolist()],
                    "seeds": sorted(tracker.seeds_), "device": draw().tolist()}
            for name in sorted(tracker.get_states()):
                with tracker.fork(name):
                    seen[name] = draw().tolist()
            return seen

        layouts = [(0, 0, 0, 0, None), (1, 0, 1, 0, None), (3, 2, 1, 1, None),
                   (7, 5, 3, 2, None), (2, 1, 0, 3, 4)]
        for tp, ep, etp, pp, dp in layouts:
            megatron_set_random_seed(1234, tp, ep, etp, pp, dp)
            expected = observe()

            tracker_module.model_parallel_cuda_manual_seed(   # the states the block finds
                77, tp_rank=tp, ep_rank=ep, etp_rank=etp, force_reset_rng=True
            )
            observe()
            detctx_megatron.register_tracker(tp_rank=tp, ep_rank=ep, etp_rank=etp)
            if pp == 0 and dp is None:
                block = detctx.deterministic(seed=1234)
            else:
                stage = MegatronSeeds(pp_rank=pp, dp_rank=dp)
                block = detctx.distributed_deterministic(seed=1234, megatron_seeds=stage)
            with block as seeding:
                assert "megatron" in seeding.sources, seeding.sources
                inside = observe()
            detctx.unregister_source("megatron")
            assert inside == expected, (tp, ep, etp, pp, dp)
            assert expected["seeds"] == sorted(
                detctx_megatron.tracker_seeds(seeding.seed, tp, ep, etp).values()
            )
            print(tp, ep, etp, pp, dp, seeding.seed)
        """
    )
    assert out.split("\n")[:5] == [
        "0 0 0 0 None 1234",
        "1 0 1 0 None 1234",
        "3 2 1 1 None 1334",
        "7 5 3 2 None 1434",
        "2 1 0 3 4 1574",
    ]


@pytest.mark.slow
def test_ranks_come_from_megatrons_parallel_state_once_it_is_initialised() -> None:
    out = run_on_npu(
        """
        from megatron.core import parallel_state

        source = detctx_megatron.register_tracker()
        tracker_module.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
        try:
            with detctx.deterministic(seed=1):
                pass
        except RuntimeError as exc:
            print("before:", "tp_rank is unknown" in str(exc))

        parallel_state.model_parallel_is_initialized = lambda: True
        parallel_state.set_tensor_model_parallel_rank(3)
        parallel_state.set_expert_model_parallel_rank(1)
        parallel_state.set_expert_tensor_parallel_rank(2)
        print("ranks:", source.rank("tp_rank"), source.rank("ep_rank"), source.rank("etp_rank"))
        with detctx.deterministic(seed=1):
            seeds = sorted(tracker_module.get_cuda_rng_tracker().seeds_)
        print("seeds:", seeds == sorted(detctx_megatron.tracker_seeds(1, 3, 1, 2).values()))
        """
    )
    assert out.split("\n")[:3] == ["before: True", "ranks: 3 1 2", "seeds: True"]


# --- capture, restore, scoped evaluation ----------------------------------------------------


@pytest.mark.slow
def test_capture_and_restore_bring_back_every_stream_fork_draws_from() -> None:
    out = run_on_npu(
        """
        from hypothesis import given, settings, strategies as st

        detctx_megatron.register_tracker(tp_rank=1, ep_rank=0, etp_rank=1)
        tracker_module.model_parallel_cuda_manual_seed(42, tp_rank=1, ep_rank=0, etp_rank=1)
        tracker = tracker_module.get_cuda_rng_tracker()
        names = sorted(tracker.get_states())

        def draws_after():
            seen = [draw(2).tolist()]
            for name in names:
                with tracker.fork(name):
                    seen.append(draw(2).tolist())
            return seen

        @settings(max_examples=25, deadline=None)
        @given(st.lists(st.tuples(st.sampled_from([None, *names]), st.integers(1, 5)), max_size=6))
        def restore_undoes_any_drawing(steps):
            state = detctx.capture()
            expected = draws_after()
            state.restore()
            for name, count in steps:              # dropout in and out of fork()
                if name is None:
                    draw(count)
                else:
                    with tracker.fork(name):
                        draw(count)
            state.restore()
            assert draws_after() == expected

        restore_undoes_any_drawing()
        print(sorted(detctx.capture()["megatron"]["states"]) == names)
        """
    )
    assert out.strip() == "True"


@pytest.mark.slow
def test_an_eval_pass_in_its_own_block_leaves_the_training_numbers_unchanged() -> None:
    out = run_on_npu(
        """
        tracker_module.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        start = detctx.capture()                         # every stream, the tracker's too
        detctx.unregister_source("megatron")

        def train(eval_every):
            start.restore()
            losses = []
            for step in range(6):
                with tracker.fork():                     # tensor-parallel dropout
                    mask = draw(8)
                losses.append(float((mask * torch.rand(8)).sum() + draw(2).sum()))
                if eval_every and step % eval_every == 0:
                    with detctx.deterministic(seed=0):   # the eval pass, with its dropout
                        with tracker.fork():
                            draw(16)
                        draw(3)
            return losses

        # Without the tracker as a source the eval pass moves its stream:
        moved = train(eval_every=0) != train(eval_every=2)
        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        never, every_other = train(eval_every=0), train(eval_every=2)
        print(moved, never == every_other == train(eval_every=1))
        """
    )
    assert out.split() == ["True", "True"]


@pytest.mark.slow
def test_states_the_body_builds_stay_after_the_block() -> None:
    out = run_on_npu(
        """
        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        with detctx.deterministic(seed=3):
            tracker_module.model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        with tracker.fork():                             # the model can still use its tracker
            draw()
        print(sorted(tracker.get_states()))
        """
    )
    assert out.strip() == str(["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"])


@pytest.mark.slow
def test_a_block_inside_a_fork_leaves_the_forks_stream_as_if_it_never_ran() -> None:
    out = run_on_npu(
        """
        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        tracker_module.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        start = detctx.capture()

        def dropout_around(block):
            start.restore()
            with tracker.fork():
                seen = [draw()]
                if block:
                    with detctx.deterministic(seed=3):
                        draw()
                seen.append(draw())
            with tracker.fork():
                seen.append(draw())
            return [values.tolist() for values in seen]

        print(dropout_around(block=False) == dropout_around(block=True))
        """
    )
    assert out.strip() == "True"


@pytest.mark.slow
def test_a_graph_safe_tracker_keeps_its_generator_objects() -> None:
    # A graph-safe tracker (use_cudagraphable_rng) holds generators, which CUDA graphs
    # refer to; CPU generators stand in for them here.
    out = run_on_npu(
        """
        detctx_megatron.register_tracker(tp_rank=1, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        generators = {name: torch.Generator().manual_seed(index) for index, name in
                      enumerate(["data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"])}
        tracker.set_states(dict(generators))
        mp = generators["model-parallel-rng"]

        state = detctx.capture()
        expected = torch.rand(3, generator=mp)
        state.restore()
        restored = torch.equal(torch.rand(3, generator=mp), expected)
        before_block = mp.get_state()
        with detctx.deterministic(seed=10):
            seeds = detctx_megatron.tracker_seeds(10, 1, 0, 0)
            seeded = all(
                torch.equal(generators[name].get_state(),
                            torch.Generator().manual_seed(seeds[name]).get_state())
                for name in generators
            )
        same_objects = all(tracker.get_states()[name] is generators[name] for name in generators)
        print(restored, seeded, same_objects, torch.equal(mp.get_state(), before_block))
        """
    )
    assert out.split() == ["True", "True", "True", "True"]


# --- no tracker, no device ------------------------------------------------------------------


@pytest.mark.slow
def test_without_megatron_imported_the_source_holds_nothing_and_imports_nothing() -> None:
    out = run_python(
        """
        import sys, detctx
        from detctx.integrations import megatron as detctx_megatron
        detctx_megatron.register_tracker()
        with detctx.deterministic(seed=1):
            state = detctx.capture()
        detctx.restore(state.state_dict())
        # Finding megatron-core imports its namespace package only (no code runs).
        print(state["megatron"], [name for name in sys.modules if name.startswith("megatron.")])
        """
    )
    assert out.strip() == "None []"


@pytest.mark.slow
def test_before_the_tracker_is_built_no_tracker_is_built_and_no_device_is_woken() -> None:
    out = run_on_npu(
        """
        import simulated_npu as sim

        detctx_megatron.register_tracker()               # ranks unknown: no parallel_state yet
        with detctx.deterministic(seed=1):
            state = detctx.capture()
        detctx.fingerprint()
        detctx.restore(state.state_dict())
        print(state["megatron"], tracker_module._CUDA_RNG_STATE_TRACKER, sim.init_count)
        tracker_module.get_cuda_rng_tracker()            # built, but nothing added
        with detctx.deterministic(seed=1):
            print(detctx.capture()["megatron"], sim.init_count)
        """
    )
    assert out.split("\n")[:2] == ["None None 0", "None 0"]


# --- checkpoints ----------------------------------------------------------------------------


@pytest.mark.slow
def test_tracker_states_round_trip_through_a_weights_only_checkpoint() -> None:
    out = run_on_npu(
        """
        import io

        detctx_megatron.register_tracker(tp_rank=2, ep_rank=1, etp_rank=0)
        tracker_module.model_parallel_cuda_manual_seed(9, tp_rank=2, ep_rank=1, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        with tracker.fork():
            draw(5)
        buffer = io.BytesIO()
        torch.save(detctx.capture().state_dict(), buffer)
        with tracker.fork():
            expected = draw()
        with tracker.fork("expert-parallel-rng"):
            draw(7)

        buffer.seek(0)
        detctx.restore(torch.load(buffer, weights_only=True))
        with tracker.fork():
            print(torch.equal(draw(), expected))
        buffer.seek(0)
        entry = torch.load(buffer, weights_only=True)["sources"]["megatron"]
        print(entry["kind"], sorted(entry["state"]["states"]), entry["state"]["seeds"])
        """
    )
    assert out.split("\n")[:2] == [
        "True",
        "custom ['data-parallel-rng', 'expert-parallel-rng', 'model-parallel-rng'] "
        f"{sorted(tracker_seeds(9, 2, 1, 0).values())}",
    ]


@pytest.mark.slow
def test_crafted_tracker_states_are_refused_with_nothing_changed() -> None:
    out = run_on_npu(
        """
        import copy

        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        tracker_module.model_parallel_cuda_manual_seed(9, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        good = detctx.capture().state_dict()
        with tracker.fork():
            draw(3)                                     # the state now differs from `good`
        mp = "model-parallel-rng"

        def crafted(change):
            plain = copy.deepcopy(good)
            change(plain["sources"]["megatron"])
            return plain

        def put(key, value):
            return lambda entry: entry["state"].__setitem__(key, value)

        def put_state(name, value):
            return lambda entry: entry["state"]["states"].__setitem__(name, value)

        size = good["sources"]["megatron"]["state"]["states"][mp].numel()
        seeds = good["sources"]["megatron"]["state"]["seeds"]
        cases = {
            "a list for the dict": lambda entry: entry.__setitem__("state", [1, 2]),
            "an extra key": put("extra", 1),
            "no states": put("states", {}),
            "float state": put_state(mp, torch.zeros(size)),
            "2-D state": put_state(mp, torch.zeros(1, size, dtype=torch.uint8)),
            "short state": put_state(mp, torch.zeros(16, dtype=torch.uint8)),
            "garbage state": put_state(mp, torch.full((size,), 7, dtype=torch.uint8)),
            "a new name": put_state("other-rng", torch.zeros(size, dtype=torch.uint8)),
            "a name missing": lambda entry: entry["state"]["states"].pop(mp),
            "a negative seed": put("seeds", [-1]),
            "a bool seed": put("seeds", [True]),
            "seeds not a list": put("seeds", 5),
            "a seed twice": put("seeds", [*seeds, seeds[0]]),
            "a state's seed not on record": put("seeds", seeds[1:]),
            "a million seeds": put("seeds", [*seeds, *range(2**40, 2**40 + 10**6)]),
        }
        before, states = detctx.fingerprint(), tracker.get_states()
        for what, change in cases.items():
            try:
                detctx.restore(crafted(change))
            except detctx.CheckpointError as exc:
                assert "megatron" in str(exc), str(exc)
                unchanged = detctx.fingerprint() == before and tracker.get_states() == states
                print(what, "refused", "unchanged" if unchanged else "CHANGED")
            else:
                print(what, "ACCEPTED")
        """
    )
    lines = [line for line in out.splitlines() if line]
    assert len(lines) == 15
    assert all(line.endswith("refused unchanged") for line in lines), out


@pytest.mark.slow
def test_nested_blocks_keep_one_seed_per_state_on_record_so_a_checkpoint_inside_restores() -> None:
    out = run_on_npu(
        """
        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        tracker_module.model_parallel_cuda_manual_seed(9, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        tracker.add("mine", 4321)                     # a state no Megatron rule seeds
        with detctx.deterministic(seed=1), detctx.deterministic(seed=2):
            inner = detctx.capture().state_dict()
            with tracker.fork("mine"):
                expected = draw()
        seeds = inner["sources"]["megatron"]["state"]["seeds"]
        print(seeds == sorted([4321, *detctx_megatron.tracker_seeds(2, 0, 0, 0).values()]))
        detctx.restore(inner)
        with tracker.fork("mine"):
            print(torch.equal(draw(), expected))
        try:
            tracker.add("another", 4321)              # its seed is still on record
        except Exception as exc:
            print("refused:", "4321" in str(exc))
        """
    )
    assert out.split("\n")[:3] == ["True", "True", "refused: True"], out


def test_a_tracker_state_named_with_the_empty_string_round_trips_through_a_checkpoint() -> None:
    out = run_on_npu(
        """
        import io

        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        tracker_module.model_parallel_cuda_manual_seed(9, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = tracker_module.get_cuda_rng_tracker()
        tracker.add("", 4321)                         # Megatron takes any name
        buffer = io.BytesIO()
        torch.save(detctx.capture().state_dict(), buffer)
        with tracker.fork(""):
            expected = draw()

        buffer.seek(0)
        detctx.restore(torch.load(buffer, weights_only=True))
        with tracker.fork(""):
            print(torch.equal(draw(), expected))
        try:
            tracker.add("another", 4321)              # its seed is still on record
        except Exception as exc:
            print("refused:", "4321" in str(exc))
        """
    )
    assert out.split("\n")[:2] == ["True", "refused: True"]


def test_states_whose_names_are_not_strings_are_compared_across_ranks_by_their_text() -> None:
    source = TrackerSource(tp_rank=0, ep_rank=0, etp_rank=0)
    state = torch.zeros(16, dtype=torch.uint8)
    states = {1: state, "data-parallel-rng": state, ("a", 2): state}

    parts = source.agreement_parts({"states": states, "seeds": []})

    assert [(name, scope) for name, scope, _ in parts] == [
        ("('a', 2)", None),
        ("1", None),
        ("data-parallel-rng", ""),
    ]


def test_states_whose_names_read_alike_are_refused_rather_than_merged() -> None:
    source = TrackerSource(tp_rank=0, ep_rank=0, etp_rank=0)
    state = torch.zeros(16, dtype=torch.uint8)

    with pytest.raises(ValueError, match="read alike"):
        source.agreement_parts({"states": {1: state, "1": state}, "seeds": []})


@pytest.mark.slow
def test_a_checkpoint_with_tracker_states_needs_a_tracker_to_go_into() -> None:
    out = run_on_npu(
        """
        detctx_megatron.register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
        tracker_module.model_parallel_cuda_manual_seed(9, tp_rank=0, ep_rank=0, etp_rank=0)
        saved = detctx.capture().state_dict()
        tracker_module._CUDA_RNG_STATE_TRACKER_INITIALIZED = False   # a process without one
        tracker_module._CUDA_RNG_STATE_TRACKER = None
        try:
            detctx.restore(saved)
        except detctx.CheckpointError as exc:
            print("model_parallel_cuda_manual_seed" in str(exc))
        """
    )
    assert out.strip() == "True"


# --- without a subprocess: arguments, seeds and the rank-check rule --------------------------


def test_megatrons_seed_rule() -> None:
    assert tracker_seeds(1234, tp_rank=3, ep_rank=2, etp_rank=1) == {
        "data-parallel-rng": 1234,
        "model-parallel-rng": 1234 + 2718 + 3,
        "expert-parallel-rng": 1234 + 1024 + 200 + 1,
    }
    assert MegatronSeeds(pp_rank=2).seed_for(1234) == 1434
    assert MegatronSeeds(pp_rank=2, dp_rank=3).seed_for(1234) == 1464
    assert MegatronSeeds(pp_rank=1).seed_for(2**32 - 50) == 50  # past NumPy's limit: wraps


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda: TrackerSource(tp_rank=-1), TypeError),
        (lambda: TrackerSource(ep_rank=True), TypeError),
        (lambda: TrackerSource(etp_rank=1.0), TypeError),
        (lambda: register_tracker(tp_rank="0"), TypeError),
        (lambda: MegatronSeeds(pp_rank=-1), ValueError),
        (lambda: MegatronSeeds(pp_rank=0, dp_rank=True), TypeError),
        (lambda: distributed_deterministic(megatron_seeds=3), TypeError),
        (
            lambda: distributed_deterministic(per_rank=True, megatron_seeds=MegatronSeeds(0)),
            ValueError,
        ),
    ],
)
def test_bad_ranks_and_options_fail_when_given(build: Any, error: type) -> None:
    with pytest.raises(error):
        build()
    assert "megatron" not in dict(detctx._sources.registry.registered_sources())


def test_without_megatron_core_registering_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def nothing_found(name: str, *args: Any) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr("importlib.util.find_spec", nothing_found)
    with pytest.raises(detctx.MissingDependencyError, match=r"detctx\[megatron\]"):
        register_tracker()


def test_outside_a_process_group_megatron_seeds_offset_this_stage() -> None:
    import random

    with distributed_deterministic(seed=1234, megatron_seeds=MegatronSeeds(pp_rank=2)) as run:
        drawn = random.random()
    assert (run.seed, run.shared_seed, drawn) == (1434, 1234, random.Random(1434).random())
    assert "megatron_seeds=MegatronSeeds(pp_rank=2, dp_rank=None)" in repr(
        distributed_deterministic(seed=1, megatron_seeds=MegatronSeeds(pp_rank=2))
    )


def test_ranks_deriving_their_seeds_differently_raise_the_same_error() -> None:
    with pytest.raises(SeedMismatchError) as caught:
        decide([[9, 1, 0], [9, 1, 2], [9, 1, 2]], 0)
    assert "per_rank=False on rank 0; megatron_seeds (pipeline offsets) on ranks 1-2" in str(
        caught.value
    )


class ScopedSource:
    """A source whose state has a part every rank shares and one shared within a group."""

    def __init__(self, shared: int, grouped: int, group: int) -> None:
        self.state = {"shared": shared, "grouped": grouped}
        self.group = group

    def capture(self) -> Any:
        return dict(self.state)

    def restore(self, state: Any) -> None:
        self.state = dict(state)

    def seed(self, seed: int) -> None:
        self.state = {"shared": seed, "grouped": seed + self.group}

    def agreement_parts(self, state: Any) -> list[tuple[str, str | None, Any]]:
        grouped = ("grouped", f"group={self.group}", state["grouped"])
        return [("shared", "", state["shared"]), grouped]


def rows_of(*sources: ScopedSource) -> tuple[list[list[int]], list[str]]:
    made = [verification_row(None, [("scoped", source)]) for source in sources]
    return [row for row, _ in made], made[0][1]


GROUPS = ((10, 0), (10, 0), (11, 1), (11, 1))


def test_a_part_is_compared_only_among_ranks_that_share_its_scope() -> None:
    # Ranks 0, 1 in group 0 and 2, 3 in group 1: the grouped part differs across groups.
    rows, names = rows_of(*(ScopedSource(5, grouped, group) for grouped, group in GROUPS))
    assert names == ["scoped[shared]", "scoped[grouped]"]
    assert compare_rows(rows, rows[0], names) == {}
    # Rank 3 drew from its group's stream, rank 1 from the shared one.
    shared, grouped = (5, 6, 5, 5), (10, 10, 11, 12)
    rows, names = rows_of(*map(ScopedSource, shared, grouped, (0, 0, 1, 1)))
    assert compare_rows(rows, rows[0], names) == {1: ("scoped[shared]",), 3: ("scoped[grouped]",)}


def test_a_part_without_a_scope_is_compared_with_no_rank() -> None:
    class Unscoped(ScopedSource):
        def agreement_parts(self, state: Any) -> list[tuple[str, str | None, Any]]:
            return [("alone", None, state["grouped"])]

    rows, names = rows_of(Unscoped(1, 1, 0), Unscoped(1, 2, 0), Unscoped(1, 3, 0))
    assert compare_rows(rows, rows[0], names) == {}


# --- two gloo ranks -------------------------------------------------------------------------

WORKER = Path(__file__).with_name("megatron_ranks.py")


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    if not dist.is_available():
        pytest.skip("torch.distributed is absent")
    return launch_ranks(WORKER, 2, timeout=240)


@pytest.mark.slow
def test_tensor_parallel_ranks_agree_on_everything_but_their_model_parallel_state(
    two_ranks: list[dict[str, Any]],
) -> None:
    for seen in two_ranks:
        assert seen["tp"]["model_parallel_states_differ"]
        assert seen["tp"]["in_step"] is None
        assert seen["tp"]["extra_model_parallel_draw"] is None        # not compared: by design
        assert seen["tp"]["extra_data_parallel_draw"] == {"1": ["megatron[data-parallel-rng]"]}


def test_data_parallel_replicas_must_agree_on_their_model_parallel_state(
    two_ranks: list[dict[str, Any]],
) -> None:
    for seen in two_ranks:
        assert seen["dp"]["in_step"] is None
        assert seen["dp"]["extra_model_parallel_draw"] == {"1": ["megatron[model-parallel-rng]"]}


def test_pipeline_stages_under_megatron_seeds_are_seeded_and_compared_apart(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert [seen["pp"]["seed"] for seen in two_ranks] == [5, 105]
    assert all(seen["pp"]["verified"] is None for seen in two_ranks)
    assert all(seen["pp"]["one_stage"] == {"1": ["torch"]} for seen in two_ranks)


# --- CUDA -----------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ON_CUDA = """
import io, warnings
import torch, detctx
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.tensor_parallel import random as tracker_module
from detctx.integrations import megatron as detctx_megatron

def dropout():
    return torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()
"""


@pytest.mark.cuda
@cuda_only
def test_on_cuda_capture_never_wakes_the_device() -> None:
    out = run_python(
        ON_CUDA
        + textwrap.dedent(
            """
            before = torch.cuda.is_initialized()          # importing Megatron may wake it
            detctx_megatron.register_tracker()
            with detctx.deterministic(seed=1):
                detctx.capture()
            detctx.fingerprint()
            print(before, torch.cuda.is_initialized())
            """
        )
    )
    before, after = out.split()
    if before == "True":
        pytest.skip("importing megatron-core initialised CUDA on this machine")
    assert after == "False"


@pytest.mark.cuda
@cuda_only
def test_on_cuda_the_block_seeds_restores_and_checkpoints_tracker_dropout() -> None:
    out = run_python(
        ON_CUDA
        + textwrap.dedent(
            """
            warnings.simplefilter("ignore", detctx.DeterminismWarning)
            detctx_megatron.register_tracker(tp_rank=1, ep_rank=0, etp_rank=1)

            def megatron_seed(seed):
                # force_reset_rng builds a new tracker: fetch it again after each call.
                tracker_module.model_parallel_cuda_manual_seed(
                    seed, tp_rank=1, ep_rank=0, etp_rank=1, force_reset_rng=True
                )
                return tracker_module.get_cuda_rng_tracker()

            tracker = megatron_seed(1234)
            expected = {name: state.clone() for name, state in tracker.get_states().items()}
            with tracker.fork():
                reference = dropout()
            tracker = megatron_seed(77)
            with detctx.deterministic(seed=1234):
                states = tracker.get_states()
                same = all(torch.equal(states[name], expected[name]) for name in expected)
                with tracker.fork():
                    seeded = torch.equal(dropout(), reference)
            print(same, seeded)

            buffer = io.BytesIO()
            torch.save(detctx.capture().state_dict(), buffer)
            with tracker.fork():
                first = dropout()
            buffer.seek(0)
            detctx.restore(torch.load(buffer, weights_only=True))
            with tracker.fork():
                print(torch.equal(dropout(), first))

            buffer.seek(0)
            crafted = torch.load(buffer, weights_only=True)
            state = crafted["sources"]["megatron"]["state"]["states"]["model-parallel-rng"]
            state[8:] = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)  # offset 1
            try:
                detctx.restore(crafted)
            except detctx.CheckpointError as exc:
                print("refused", "device" in str(exc))
            """
        )
    )
    assert out.split("\n")[:3] == ["True True", "True", "refused True"]
