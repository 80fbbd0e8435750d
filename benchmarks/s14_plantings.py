"""Scenario 14: does ``detctx compare`` name a planted change, under kernel noise?

Four model families (``benchmarks/planting_models.py``: HF GPT-2, HF Llama, a ResNet-style
CNN with BatchNorm, an LSTM LM), each built from a config, one training step each
(forward, backward, AdamW), one torch thread. Run A: the default settings, recorded once
per family. Run B: a noise setting (the same settings; oneDNN off; channels_last; 2
threads against 1; SDPA's math kernel against its default), with one change planted:

- at a recorded op drawn at random (seeded) from B's forward, backward and optimizer ops:
  its output scaled by 1+1e-2, 1+1e-3 or 1+1e-4, or rounded to bfloat16 and back
  (:class:`benchmarks.planting.Planter`); expected origin: that op's index in B;
- in a module drawn at random: a norm's eps times 10 or 2, GELU switched to its tanh
  form; expected origin: an op of that module.

Each planting's own error is measured: exactly for an op-level change, for a module
change as the compare estimates it between B with and without the change (same settings,
so the first op where the bits part is the change's). An op inside a module that A runs
as one fused kernel (the LSTM with oneDNN on, against its per-step ops in B) has no
partner: the compare sees such a change where the module's values leave it, so that is
its size, and naming the module there counts as naming it exactly. Against float32's tolerance
(3e-4) a planting is *clear* (at least 3x), *marginal* or *sub-tolerance* (below 1x).
Every planted run is also checked against the same run without the change: the bits
must first part at the planted op, or the planting is reported as not made.

Reported per family and setting: clear plantings named exactly (target 95% under noise,
100% without), how many were "agree" or "no origin" (target 0), sub-tolerance plantings
whose inputs had the same bits (and whether anything names them), and noise-only pairs
(no planting, a fresh seed each): how many report an origin (target 0) and how many
could not be compared (exit 2; target 0).

    python -m benchmarks.s14_plantings [--quick] [--json plantings.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.harness import Result, Row, Settings, Stats
from benchmarks.planting import CHANGES, Plan, record
from benchmarks.planting_models import FAMILIES, Family, ModuleChange
from benchmarks.planting_results import (
    Outcome,
    Pair,
    count,
    missed_table,
    pair_table,
    planting_table,
    share,
)

SCENARIO = "14 plantings"
NOISY: Final = ("onednn_off", "channels_last", "threads_2", "sdpa_math")
SAME: Final = (8, 6)
"""Without noise: 8 ops of each phase (forward, backward, optimizer), 6 module changes."""
NOISE: Final = (4, 3)
"""Under each noise setting: 4 ops of each phase, 3 module changes."""
QUICK: Final = (1, 2)
PAIRS: Final = 60


def phases(trace: Any) -> np.ndarray:
    """Per recorded op: 0 forward (before the first backward op), 1 backward, 2 after it."""
    nodes = np.array([trace.text(int(n)) != "" for n in trace.ops["node"]])
    phase = np.zeros(len(trace), dtype=np.int64)
    if nodes.any():
        phase[np.flatnonzero(nodes)[0] :] = 2
        phase[nodes] = 1
    return phase


def draw(
    family: Family,
    model: torch.nn.Module,
    setting: str,
    clean: Any,
    per_phase: int,
    modules: int,
    rng: random.Random,
) -> list[Plan]:
    """Plantings drawn from B's clean trace: ``per_phase`` ops of each phase whose first
    output is float, and ``modules`` module changes."""
    phase = phases(clean)
    first_dtype = [clean.text(int(d)) for d in clean.values["dtype"][clean.first_value[:-1]]]
    # The program's ops: not the rows detctx adds (data no op made, where first read).
    programs = np.array(
        [not clean.text(int(op)).startswith("detctx::") for op in clean.ops["op"]], dtype=bool
    )
    ordinal = np.cumsum(programs) - 1
    plans = []
    for number, label in enumerate(("forward", "backward", "optimizer")):
        candidates = [
            i
            for i in np.flatnonzero((phase == number) & programs).tolist()
            if first_dtype[i].startswith("float")
        ]
        for index in rng.sample(candidates, min(per_phase, len(candidates))):
            change = rng.choice(list(CHANGES))
            name = clean.text(int(clean.ops["op"][index]))
            plans.append(
                Plan(
                    family.name,
                    setting,
                    label,
                    change,
                    index=index,
                    name=name,
                    ordinal=int(ordinal[index]),
                )
            )
    changes: list[ModuleChange] = family.changes(model)
    for chosen in rng.sample(changes, min(modules, len(changes))):
        plans.append(Plan(family.name, setting, "module", chosen.what, module=chosen.path))
    return plans


def _digests(trace: Any) -> np.ndarray:
    return np.stack([trace.ops["high"], trace.ops["low"]], axis=1)


def first_parted(clean: Any, planted: Any) -> int:
    """The first op whose outputs' bits differ between two traces of one setting (-1: none)."""
    if len(clean) != len(planted):
        return min(len(clean), len(planted))
    differ = np.flatnonzero((_digests(clean) != _digests(planted)).any(axis=1))
    return int(differ[0]) if len(differ) else -1


def evaluate(
    family: Family,
    model: torch.nn.Module,
    batch: Any,
    plan: Plan,
    a_path: Path,
    clean_path: Path,
    folder: Path,
) -> Outcome:
    import detctx
    from detctx._basics import TraceError
    from detctx._compare.reading import read_trace

    started = time.perf_counter()
    path = folder / "planted.trace"
    planter = record(family, model, batch, plan.setting, path, plan)
    clean, planted = read_trace(clean_path), read_trace(path)
    parted = first_parted(clean, planted)
    if planter is not None:
        own = planter.own_error
        made = parted == plan.index and planter.planted_name == plan.name
        expected = plan.index
    else:
        own = float("nan")
        made = parted >= 0 and _in_module(planted, parted, plan.module)
        expected = parted
        if made:
            own = float(detctx.compare_traces(clean_path, path).ranks[0].error[parted])
    try:
        result = detctx.compare_traces(a_path, path)
    except TraceError as exc:
        return Outcome(
            plan,
            own,
            made,
            expected,
            False,
            "not compared",
            {"error": _said(exc, a_path, path)},
            time.perf_counter() - started,
        )
    rank = result.ranks[0]
    # An op inside a module A runs as one fused kernel (an LSTM layer) has no partner: the
    # compare sees the change where the module's values leave it, so that is its size, and
    # naming the module is naming it exactly.
    module = rank.inside.get(expected) if planter is not None and made else None
    if module is not None and rank.alignment.partner[expected] < 0:
        own = _at_boundary(rank, expected, module, clean_path, path)
    else:
        module = None
    inputs_same = bool(made and rank.input_error[expected] == 0)
    producers = rank.b.inputs["op"][rank.b.first_input[expected] : rank.b.first_input[expected + 1]]
    unrecorded = bool(made and (producers < 0).any())
    origin = result.origin
    if result.agree:
        verdict = "agree"
    elif origin is None:
        verdict = "no origin"
    elif (
        (origin.index == expected or (module is not None and origin.inside == module))
        if planter is not None
        else _in_module(planted, origin.index, plan.module)
    ):
        verdict = "named"
    else:
        verdict = "elsewhere"
    found = (
        None
        if origin is None
        else {
            key: getattr(origin, key)
            for key in ("index", "op", "module_path", "source", "error", "tolerance", "input_error")
        }
    )
    # Where the bits part with the same inputs (``bits_part``, where this detctx has it).
    parts = [part.index for part in getattr(result, "bits_part", [])]
    named_part = (
        (expected in parts)
        if planter is not None
        else any(_in_module(planted, index, plan.module) for index in parts)
    )
    return Outcome(
        plan,
        own,
        made,
        expected,
        inputs_same,
        verdict,
        found,
        time.perf_counter() - started,
        named_part,
        unrecorded,
    )


def _at_boundary(rank: Any, planted: int, module: str, clean: Path, path: Path) -> float:
    """A change at op ``planted`` inside a fused ``module``, as large as it is where it
    first leaves the module: the largest error (B against B without the change) at the
    first run of paired ops after it that read the module's values."""
    import detctx

    error = detctx.compare_traces(clean, path).ranks[0].error
    paired = np.flatnonzero(rank.alignment.partner >= 0)
    later = paired[paired > planted]
    leaving = np.array([rank.inside.get(int(op)) == module for op in later], dtype=bool)
    if not leaving.any():
        return 0.0
    first = int(np.argmax(leaving))
    stop = np.flatnonzero(~leaving[first:])
    run = later[first : first + (int(stop[0]) if len(stop) else len(later))]
    return float(np.nanmax(error[run]))


def _said(error: Exception, a: Path, b: Path) -> str:
    """The error's first line, the traces' paths as A and B."""
    return str(error).splitlines()[0].replace(str(a), "A").replace(str(b), "B")


def _in_module(trace: Any, index: int, module: str) -> bool:
    """Whether op ``index`` ran in the forward pass of ``module`` (a ``named_modules`` name;
    a trace's module path starts with the root module's class name)."""
    path = trace.text(int(trace.ops["module"][index]))
    node = trace.text(int(trace.ops["node"][index]))
    return node == "" and (path == module or path.endswith("." + module))


def noise_pair(family: Family, setting: str, seed: int, folder: Path) -> Pair:
    import detctx
    from detctx._basics import TraceError

    model, batch = family.build(seed)
    a, b = folder / "noise-a.trace", folder / "noise-b.trace"
    record(family, model, batch, "same", a)
    record(family, model, batch, setting, b)
    try:
        result = detctx.compare_traces(a, b)
    except TraceError as exc:
        return Pair(
            family.name, setting, seed, "not compared", {"error": _said(exc, a, b)}, float("nan")
        )
    errors = result.ranks[0].error
    largest = float(np.nanmax(errors)) if np.isfinite(errors).any() or len(errors) else 0.0
    origin = result.origin
    if result.bitwise:
        verdict = "bitwise"
    elif result.agree:
        verdict = "agree"
    else:
        verdict = "no origin" if origin is None else "origin"
    found = (
        None
        if origin is None
        else {
            key: getattr(origin, key)
            for key in ("index", "op", "module_path", "error", "input_error", "difference")
        }
    )
    return Pair(family.name, setting, seed, verdict, found, largest)


def check_stacking(family: Family, folder: Path) -> str:
    """The same planting with the planting mode entered below the recorder (before the
    recording) and above it (inside): which op the compare names each time."""
    import detctx
    from detctx._compare.reading import read_trace

    model, batch = family.build(0)
    a = folder / "stack-a.trace"
    record(family, model, batch, "same", a)
    trace = read_trace(a)
    programs = np.array(
        [not trace.text(int(op)).startswith("detctx::") for op in trace.ops["op"]], dtype=bool
    )
    forward = np.flatnonzero((phases(trace) == 0) & programs)
    index = int(forward[len(forward) // 2])
    name = trace.text(int(trace.ops["op"][index]))
    ordinal = int(programs[:index].sum())
    plan = Plan(
        family.name, "same", "forward", "x(1+1e-2)", index=index, name=name, ordinal=ordinal
    )
    said = []
    for inside in (False, True):
        b = folder / "stack-b.trace"
        record(family, model, batch, "same", b, plan, inside=inside)
        origin = detctx.compare_traces(a, b).origin
        where = "no origin" if origin is None else f"op {origin.index} {origin.op}"
        said.append(f"{'inside' if inside else 'before'} the recording: {where}")
    return f"{family.name}, op {index} {name} x(1+1e-2), mode entered " + "; ".join(said)


def run_family(
    family: Family,
    sizes: dict[str, tuple[int, int]],
    folder: Path,
    log: Any,
) -> list[Outcome]:
    """Every planting of ``family`` under each setting of ``sizes`` (setting -> ops per
    phase, module changes), against one recording of A."""
    from detctx._compare.reading import read_trace

    model, batch = family.build(0)
    a = folder / f"{family.name}-a.trace"
    record(family, model, batch, "same", a)
    outcomes = []
    for setting, (per_phase, modules) in sizes.items():
        clean_path = folder / f"{family.name}-{setting}.trace"
        record(family, model, batch, setting, clean_path)
        rng = random.Random(f"{family.name}/{setting}")
        plans = draw(family, model, setting, read_trace(clean_path), per_phase, modules, rng)
        for plan in plans:
            outcome = evaluate(family, model, batch, plan, a, clean_path, folder)
            outcomes.append(outcome)
            log(
                f"{family.name:5} {setting:13} {plan.phase:9} {plan.change:22} "
                f"{plan.index if plan.phase != 'module' else plan.module:>24} "
                f"own {outcome.own_error:8.2e} {'made' if outcome.made else 'NOT MADE'} "
                f"-> {outcome.verdict}{' (bits part named)' if outcome.bits_part else ''}"
                + (
                    ""
                    if outcome.origin is None or outcome.verdict == "named"
                    else f" {outcome.origin}"
                )
            )
    return outcomes


def run(
    settings: Settings,
    families: tuple[str, ...] | None = None,
    json_path: Path | None = None,
    log: Any = None,
) -> Result:
    """The tables for ``benchmarks/run_all.py`` (one family, a few plantings when quick)."""
    log = log or (lambda line: None)
    quick = settings.quick
    chosen = families or (("lstm",) if quick else tuple(FAMILIES))
    pair_count = 4 if quick else PAIRS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    outcomes: list[Outcome] = []
    pairs: list[Pair] = []
    try:
        with tempfile.TemporaryDirectory(prefix="detctx-s14-") as name:
            folder = Path(name)
            stacking = check_stacking(FAMILIES[chosen[0]], folder)
            log(stacking)
            for family_name in chosen:
                family = FAMILIES[family_name]
                if quick:
                    sizes = {setting: QUICK for setting in family.settings[:2]}
                else:
                    sizes = {s: SAME if s == "same" else NOISE for s in family.settings}
                outcomes += run_family(family, sizes, folder, log)
            combos = [(f, s) for f in chosen for s in FAMILIES[f].settings if s in NOISY]
            for number in range(pair_count):
                family_name, setting = combos[number % len(combos)]
                pair = noise_pair(FAMILIES[family_name], setting, 100 + number, folder)
                pairs.append(pair)
                log(
                    f"noise {family_name:5} {setting:13} seed {pair.seed}: {pair.verdict} "
                    f"largest {pair.largest:.2g} {pair.origin or ''}"
                )
    finally:
        torch.set_num_threads(threads)
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                {
                    "plantings": [{**asdict(o), "size": o.size} for o in outcomes],
                    "pairs": [asdict(p) for p in pairs],
                    "stacking": stacking,
                },
                indent=1,
                default=str,
            )
        )
    made = [o for o in outcomes if o.made and o.size == "clear"]
    noisy = [o for o in made if o.plan.setting != "same"]
    calm = [o for o in made if o.plan.setting == "same"]
    row = Row(
        SCENARIO,
        "one planting: record B, check it against B unplanted, compare with A",
        Stats.of([o.seconds for o in outcomes], 1),
        note=(
            f"clear plantings named: {share(count(calm, verdict='named'), len(calm))} "
            f"without noise, {share(count(noisy, verdict='named'), len(noisy))} with it; "
            f"{stacking}"
        ),
    )
    return Result([row], [planting_table(outcomes), missed_table(outcomes, 40), pair_table(pairs)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one family, a few plantings")
    parser.add_argument("--families", help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--json", type=Path, help="write every planting and pair here")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per planting")
    args = parser.parse_args(argv)
    families = None
    if args.families:
        families = tuple(name.strip() for name in args.families.split(",") if name.strip())
        unknown = [name for name in families if name not in FAMILIES]
        if unknown:
            parser.error(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    started = time.perf_counter()
    result = run(Settings.make(args.quick), families, args.json, log)
    for row in result.rows:
        print(f"{row.subject}: median {row.value.median:.2f} s" if row.value else row.subject)
        print(f"  {row.note}")
    for table in result.tables:
        print(f"\n## {table.title}\n")
        print("| " + " | ".join(table.columns) + " |")
        print("| " + " | ".join("---" for _ in table.columns) + " |")
        for cells in table.rows:
            print("| " + " | ".join(cells) + " |")
        if table.note:
            print(f"\n{table.note}")
    print(f"\n{time.perf_counter() - started:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
