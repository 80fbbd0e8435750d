"""Ctrl-C at any moment leaves no block open, no lock held and no RNG half restored.

CI sends 100 randomly timed SIGINTs (a few seconds); set
``DETCTX_HAMMER_SIGNALS=6000`` for the full hammering run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, TESTS


def test_randomly_timed_sigints_in_blocks_and_generator_steps_corrupt_nothing() -> None:
    signals = int(os.environ.get("DETCTX_HAMMER_SIGNALS", "100"))
    proc = subprocess.run(
        [sys.executable, str(TESTS / "hammer_interrupts.py"), str(signals)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60 + signals,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {
        "sent": {"blocks": signals - signals // 2, "generator steps": signals // 2},
        "corrupted": {"blocks": 0, "generator steps": 0},
        "lock_free": True,
    }
    assert proc.stderr == ""
