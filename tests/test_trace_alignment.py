"""Lining two traces up: every op that has a partner in the other trace gets it, pairs are of
equal names and in order, and the work stays linear in the traces' length when ops are
inserted, removed or repeated (60,000 ops with one extra in the middle took difflib
minutes)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import detctx._compare.matching as matching_module
from detctx._compare.align import EDITS, GAP_CELLS, Matcher, Partial, align, match
from detctx._compare.format import INPUT, OP, VALUE, Trace

Op = tuple[str, str, str]  # name, module path, autograd node ("" in the forward)
LAYERS = ("net.0", "net.1", "net.2")


def trace_of(ops: list[Op]) -> Trace:
    """A trace in memory holding these ops (no outputs: alignment reads names only)."""
    strings: dict[str, int] = {"": 0}
    rows = np.zeros(len(ops), dtype=OP)
    for column, position in (("op", 0), ("module", 1), ("node", 2)):
        rows[column] = [strings.setdefault(op[position], len(strings)) for op in ops]
    header = {"environment": {}, "run": "in memory"}
    no_values, no_inputs = np.zeros(0, dtype=VALUE), np.zeros(0, dtype=INPUT)
    return Trace(Path("memory.trace"), header, list(strings), rows, no_values, no_inputs)


def layer_forward(layer: str) -> list[Op]:
    return [("aten::t", layer, ""), ("aten::addmm", layer, ""), ("aten::relu", layer, "")]


def layer_backward(layer: str) -> list[Op]:
    return [
        ("aten::threshold_backward", layer, "ReluBackward0"),
        ("aten::mm", layer, "AddmmBackward0"),
        ("aten::mm", layer, "AddmmBackward0"),
        ("aten::sum.dim_IntList", layer, "AddmmBackward0"),
    ]


Tagged = list[tuple[Op, tuple[object, ...]]]
"""Ops, each with what it is: an op of A and one of B with the same tag are true partners."""


def training_step(
    layers: tuple[str, ...] = LAYERS,
    calls: dict[str, int] | None = None,
    optimizer: list[Op] | None = None,
) -> Tagged:
    """One step of an MLP: each layer's forward (``calls`` times), the loss, the backward,
    the optimizer (AdamW's fused kernel unless given). A layer called twice: its first
    forward is the one call's partner, and so is its first backward, the backward of the
    last call, which reads the gradient the one call's backward reads."""
    calls = calls or {}
    ops: Tagged = []
    for layer in layers:
        for call in range(calls.get(layer, 1)):
            ops += [(op, ("forward", layer, call, i)) for i, op in enumerate(layer_forward(layer))]
    loss = [("aten::mse_loss", "", ""), ("aten::mse_loss_backward", "", "MseLossBackward0")]
    ops += [(op, ("loss", i)) for i, op in enumerate(loss)]
    for layer in reversed(layers):
        for call in range(calls.get(layer, 1)):
            ops += [
                (op, ("backward", layer, call, i)) for i, op in enumerate(layer_backward(layer))
            ]
    if optimizer is None:
        return [*ops, (("aten::_fused_adamw_", "", ""), ("fused",))]
    return ops + [(op, ("unfused", i)) for i, op in enumerate(optimizer)]


def program(steps: list[Tagged]) -> tuple[list[Op], list[tuple[object, ...]]]:
    """The ops of these steps, and each op's tag with its step."""
    ops = [op for step in steps for op, _ in step]
    tags = [(number, *tag) for number, step in enumerate(steps) for _, tag in step]
    return ops, tags


def true_partners(tags_a: list[tuple[object, ...]], tags_b: list[tuple[object, ...]]) -> list[int]:
    """For each op of B, the op of A with its tag, or -1."""
    where = {tag: index for index, tag in enumerate(tags_a)}
    return [where.get(tag, -1) for tag in tags_b]


def count_work(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Keys compared by every match of the alignment, summed into the returned cell."""
    total = [0]

    class Counting(Matcher):
        def pairs(self) -> tuple[np.ndarray, np.ndarray]:
            found = super().pairs()
            total[0] += self.compared
            return found

    monkeypatch.setattr(matching_module, "Matcher", Counting)
    return total


def test_identical_traces_pair_op_for_op() -> None:
    ops, _ = program([training_step()] * 20)
    alignment = align(trace_of(ops), trace_of(ops))
    assert alignment.partner.tolist() == list(range(len(ops)))
    assert alignment.partial == [] and alignment.unmatched_modules_b == []


@pytest.mark.parametrize("length", [15_000, 60_000])
def test_one_extra_op_in_the_middle_of_a_program_without_modules_pairs_every_other_op(
    length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # x = x + 1 in a loop, and in B one x = x * 1.0 halfway.
    a = [("aten::add.Tensor", "", "")] * length
    b = [*a[: length // 2], ("aten::mul.Tensor", "", ""), *a[length // 2 :]]
    work = count_work(monkeypatch)
    alignment = align(trace_of(a), trace_of(b))
    middle = length // 2
    assert alignment.partner.tolist() == [*range(middle), -1, *range(middle, length)]
    assert alignment.partial == [Partial("", False, length, length + 1, length)]
    # Linear: a few comparisons per op, where difflib's longest blocks compared every pair.
    assert work[0] <= 3 * (len(a) + len(b))


def test_one_extra_op_of_the_same_name_leaves_only_the_last_one_unpaired() -> None:
    a = [("aten::add.Tensor", "", "")] * 60_000
    alignment = align(trace_of(a), trace_of(a + a[:1]))
    assert alignment.partner.tolist() == [*range(60_000), -1]


def test_a_whole_step_extra_at_the_end_leaves_exactly_that_step_unpaired() -> None:
    a, tags_a = program([training_step()] * 50)
    b, tags_b = program([training_step()] * 51)
    alignment = align(trace_of(a), trace_of(b))
    assert alignment.partner.tolist() == true_partners(tags_a, tags_b)
    assert alignment.partner.tolist() == [*range(len(a)), *[-1] * (len(b) - len(a))]
    assert alignment.unmatched_modules_a == []
    assert alignment.unmatched_modules_b == ["", *LAYERS]


def test_a_run_cut_short_pairs_every_op_it_ran() -> None:
    a, _ = program([training_step()] * 50)
    cut = 26 * len(training_step()) + 5  # Ctrl-C in step 27
    alignment = align(trace_of(a), trace_of(a[:cut]))
    assert alignment.partner.tolist() == list(range(cut))


def an_extra_layer_call(
    steps: int, at: int, layers: tuple[str, ...], calls: dict[str, int] | None = None
) -> tuple[list[Op], list[Op], list[int]]:
    """A trains an MLP ``steps`` steps; B the same, but step ``at`` runs ``layers`` (a layer
    more) or calls a layer twice. A's ops, B's, and each op of B's true partner."""
    a, tags_a = program([training_step()] * steps)
    odd = training_step(layers, calls)
    b, tags_b = program([training_step()] * at + [odd] + [training_step()] * (steps - at - 1))
    return a, b, true_partners(tags_a, tags_b)


def test_an_extra_layer_call_in_the_middle_of_3000_steps_leaves_only_its_ops_unpaired(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, partners = an_extra_layer_call(3000, 1500, ("net.0", "net.1", "net.extra", "net.2"))
    assert len(a) > 57_000
    work = count_work(monkeypatch)
    alignment = align(trace_of(a), trace_of(b))
    assert alignment.partner.tolist() == partners
    assert sorted(b[i][1] for i in np.flatnonzero(alignment.partner < 0)) == ["net.extra"] * 7
    assert alignment.unmatched_modules_b == ["net.extra"] and alignment.partial == []
    assert work[0] <= 3 * (len(a) + len(b))


def test_a_layer_called_twice_pairs_its_first_forward_and_the_backward_that_reads_alike() -> None:
    a, b, partners = an_extra_layer_call(40, 20, LAYERS, {"net.1": 2})
    alignment = align(trace_of(a), trace_of(b))
    assert alignment.partner.tolist() == partners
    assert sorted(alignment.partner[alignment.partner >= 0].tolist()) == list(range(len(a)))
    assert {(entry.module_path, entry.backward) for entry in alignment.partial} == {
        ("net.1", False),
        ("net.1", True),
    }


def test_a_layer_call_missing_in_b_leaves_its_ops_in_a_unpaired() -> None:
    b, a, _ = an_extra_layer_call(200, 100, ("net.0", "net.1", "net.extra", "net.2"))
    alignment = align(trace_of(a), trace_of(b))
    paired_in_a = set(alignment.partner[alignment.partner >= 0].tolist())
    assert paired_in_a == {i for i in range(len(a)) if a[i][1] != "net.extra"}
    assert (alignment.partner >= 0).all()
    assert alignment.unmatched_modules_a == ["net.extra"]


def unfused_adamw(parameters: int) -> list[Op]:
    per_parameter = [
        "aten::mul_.Tensor",
        "aten::add_.Tensor",
        "aten::lerp_.Scalar",
        "aten::mul_.Tensor",
        "aten::addcmul_.default",
        "aten::sqrt.default",
        "aten::div.Tensor",
        "aten::add_.Tensor",
        "aten::addcdiv_.default",
    ]
    return [(name, "", "") for _ in range(parameters) for name in per_parameter]


@pytest.mark.parametrize("modules", [True, False], ids=["modules", "no modules"])
def test_a_fused_optimizer_against_its_unfused_ops_pairs_every_other_op(
    modules: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def without_modules(step: Tagged) -> Tagged:
        return step if modules else [((name, "", ""), tag) for (name, _, _), tag in step]

    # 8 parameters: 72 ops in place of one, each step (more than EDITS), then the step
    # counter's add_, an op of a name the unfused ops have too.
    counter = [(("aten::add_.Tensor", "", ""), ("counter",))]
    fused = without_modules(training_step() + counter)
    unfused = without_modules(training_step(optimizer=unfused_adamw(8)) + counter)
    work = count_work(monkeypatch)
    done = []
    for steps in (250, 500):
        a, tags_a = program([fused] * steps)
        b, tags_b = program([unfused] * steps)
        alignment = align(trace_of(a), trace_of(b))
        assert alignment.partner.tolist() == true_partners(tags_a, tags_b)
        unpaired_a = set(range(len(a))) - set(alignment.partner.tolist())
        assert {a[i][0] for i in unpaired_a} == {"aten::_fused_adamw_"}
        done.append(work[0] - sum(done))
    # Linear: twice the steps, twice the work (each place the traces part costs at most
    # a search of EDITS keys a side).
    assert done[1] <= 2.1 * done[0]
    assert done[1] <= 2 * (len(a) + len(b)) + 500 * EDITS**2


def test_pairs_are_always_of_equal_names_and_in_order_whatever_the_edits() -> None:
    rng = random.Random(43)
    for _ in range(300):
        period = [rng.randrange(12) for _ in range(rng.randint(3, 25))]
        a = period * rng.randint(1, 60)
        b = list(a)
        for _ in range(rng.randint(1, 8)):
            where = rng.randint(0, len(b))
            kind = rng.random()
            if kind < 0.3:
                b[where:where] = [rng.randrange(20) for _ in range(rng.randint(1, 5))]
            elif kind < 0.6:
                del b[where : where + rng.randint(1, 30)]
            elif kind < 0.8:
                b[where:where] = b[where : where + rng.randint(1, 8)]  # repeated
            else:
                b[where : where + 2] = [50 + rng.randrange(5) for _ in range(rng.randint(20, 90))]
        pairs_a, pairs_b = match(np.array(a), np.array(b))
        assert (np.diff(pairs_a) > 0).all() and (np.diff(pairs_b) > 0).all()
        assert [a[i] for i in pairs_a] == [b[j] for j in pairs_b]


def test_a_difference_longer_than_the_search_is_passed_over_to_the_next_equal_run() -> None:
    # Two regions that differ in more than EDITS keys in a row, between equal runs.
    shared = list(range(100))
    a = shared + [1000 + i for i in range(EDITS)] + shared
    b = shared + [2000 + i for i in range(EDITS)] + shared
    pairs_a, pairs_b = match(np.array(a), np.array(b))
    expected = list(range(100)) + list(range(100 + EDITS, 200 + EDITS))
    assert pairs_a.tolist() == expected and pairs_b.tolist() == expected


def test_a_key_both_regions_passed_over_hold_pairs_where_the_region_is_small() -> None:
    shared = list(range(100))
    a = [*shared, *range(1000, 1070), 5000, *range(1070, 1100), *shared]
    b = [*shared, *range(2000, 2010), 5000, *range(2010, 2100), *shared]
    pairs_a, pairs_b = match(np.array(a), np.array(b))
    assert (a.index(5000), b.index(5000)) in set(zip(pairs_a.tolist(), pairs_b.tolist()))
    assert len(pairs_a) == 201


def test_regions_passed_over_larger_than_gap_cells_stay_unpaired() -> None:
    side = int(GAP_CELLS**0.5) + 1
    shared = list(range(100))
    a = [*shared, *range(10_000, 10_000 + side), 5000, *shared]
    b = [*shared, 5000, *range(20_000, 20_000 + side), *shared]
    matcher = Matcher(np.array(a), np.array(b))
    pairs_a, _ = matcher.pairs()
    assert len(pairs_a) == 200 and 5000 not in [a[i] for i in pairs_a]
    assert matcher.compared <= 4 * (len(a) + len(b))


def test_a_way_back_in_step_through_short_runs_beats_a_jump_to_a_long_one() -> None:
    # An MLP's 13 segments a step (module and pass); B calls its hidden layer twice in step
    # 3, which adds 5 segments, 2 of them between a run of 7 equal and the next step (the
    # second call's backward adds its gradients: one add in the layer, one outside).
    step = [6, 14, 16, 14, 20, 10, 11, 21, 15, 17, 15, 7, 10]
    odd = [6, 14, 16, 14, 16, 14, 20, 10, 11, 21, 15, 17, 15, 17, 11, 15, 7, 10]
    a, b = step * 6, step * 3 + odd + step * 2
    pairs_a, pairs_b = match(np.array(a), np.array(b))
    assert pairs_a.tolist() == list(range(len(a)))
    extra = {39 + 4, 39 + 5, 39 + 13, 39 + 14, 39 + 15}
    assert pairs_b.tolist() == [j for j in range(len(b)) if j not in extra]


def test_keys_past_31_bits_and_negative_ones_pair_with_no_table_sized_by_the_largest() -> None:
    # Names and shapes joined into one key reach 2**31 * names; a search far enough to hash
    # runs of keys once asked for a table that size (80 GiB for 5 names: MemoryError).
    big = [(name << 40) + shape for name in range(1, 6) for shape in (-1, 0, 7)]
    a = big * 40
    b = a[:200] + [(99 << 40) + 3] * (3 * EDITS) + a[200:]
    pairs_a, pairs_b = match(np.array(a, np.int64), np.array(b, np.int64))
    assert pairs_a.tolist() == list(range(len(a)))
    assert pairs_b.tolist() == list(range(200)) + list(range(200 + 3 * EDITS, len(b)))
