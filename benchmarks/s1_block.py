"""Scenario 1: enter+exit of a full block against the alternatives and the floor."""

from __future__ import annotations

import detctx
from benchmarks import baselines
from benchmarks.harness import Result, Row, Settings, Table, Target, format_stats, measure, repeated
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "1 full block"


def run(settings: Settings) -> Result:
    block = detctx.deterministic(seed=baselines.SEED)

    def detctx_block() -> None:
        with block:
            pass

    contenders = {
        "detctx": repeated(detctx_block),
        "floor": repeated(baselines.floor_block),
        "hand-written": repeated(baselines.hand_written_block),
        "fork_rng": repeated(baselines.fork_rng_block),
    }
    lightning, lightning_where = baselines.lightning_block()
    if lightning is not None:
        contenders["lightning"] = repeated(lightning)
    parts = baselines.floor_parts()
    with preserved():
        stats = measure(contenders, settings)
        part_stats = measure({name: repeated(fn) for name, fn in parts.items()}, settings)

    subject = "deterministic() enter+exit"
    value = stats["detctx"]
    rows = [
        Row(
            SCENARIO,
            subject,
            value,
            "floor (raw get/set/seed calls)",
            stats["floor"],
            Target("ratio", 1.15),
        ),
        Row(
            SCENARIO,
            subject,
            value,
            "hand-written save/seed/flags/restore",
            stats["hand-written"],
            Target("ratio", 0.4),
        ),
        Row(
            SCENARIO,
            subject,
            value,
            f"Lightning isolate_rng + seed_everything ({lightning_where})"
            if lightning is not None
            else "Lightning isolate_rng + seed_everything",
            stats.get("lightning"),
            Target("ratio", 0.4),
            note="" if lightning is not None else lightning_where,
        ),
        Row(
            SCENARIO,
            subject,
            value,
            "torch.random.fork_rng + torch.manual_seed",
            stats["fork_rng"],
            note="fork_rng saves torch CPU only; no flags, no env",
        ),
    ]
    floor_total = stats["floor"].median
    breakdown = Table(
        "Floor of a full block, by part",
        ["part", "median [IQR]", "share of the floor"],
        [
            [name, format_stats(part), f"{part.median / floor_total:.0%}"]
            for name, part in part_stats.items()
        ],
        note="Each part measured alone; the shares need not add up to exactly 100%.",
    )
    return Result(rows, [breakdown])
