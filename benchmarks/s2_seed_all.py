"""Scenario 2: ``seed_all`` against ``torch.manual_seed``-based seeding."""

from __future__ import annotations

import random

import numpy as np
import torch

import detctx
from benchmarks.baselines import SEED, mindspeed_seed_all
from benchmarks.harness import Result, Row, Settings, measure, repeated
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "2 seed_all"


def manual_seed_based() -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


def run(settings: Settings) -> Result:
    with preserved():
        stats = measure(
            {
                "detctx": repeated(lambda: detctx.seed_all(SEED)),
                "manual_seed": repeated(manual_seed_based),
                "mindspeed": repeated(mindspeed_seed_all),
            },
            settings,
        )
    subject = "seed_all()"
    return Result(
        [
            Row(
                SCENARIO,
                subject,
                stats["detctx"],
                "random.seed + np.random.seed + torch.manual_seed",
                stats["manual_seed"],
                note="seed_all also sets the switches and env vars",
            ),
            Row(
                SCENARIO,
                subject,
                stats["detctx"],
                "the same + PYTHONHASHSEED, flags, env (MindSpeed's seed_all)",
                stats["mindspeed"],
            ),
        ]
    )
