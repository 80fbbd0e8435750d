"""Scenario 4: ``capture()``, ``Snapshot.restore()`` and ``fingerprint()`` alone."""

from __future__ import annotations

import detctx
from benchmarks.baselines import raw_capture, raw_restore
from benchmarks.harness import Result, Row, Settings, measure, repeated
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "4 snapshot"


def run(settings: Settings) -> Result:
    with preserved():
        state = detctx.capture()
        raw = raw_capture()
        stats = measure(
            {
                "capture": repeated(detctx.capture),
                "restore": repeated(state.restore),
                "fingerprint": repeated(detctx.fingerprint),
                "raw capture": repeated(raw_capture),
                "raw restore": repeated(lambda: raw_restore(raw)),
            },
            settings,
        )
    raw_gets = "raw getstate + np get_state + torch get_state"
    return Result(
        [
            Row(SCENARIO, "capture()", stats["capture"], raw_gets, stats["raw capture"]),
            Row(
                SCENARIO,
                "Snapshot.restore()",
                stats["restore"],
                "raw setstate + np set_state + torch set_state",
                stats["raw restore"],
            ),
            Row(
                SCENARIO,
                "fingerprint()",
                stats["fingerprint"],
                "capture()",
                stats["capture"],
                note="fingerprint = capture + hashing every state",
            ),
        ]
    )
