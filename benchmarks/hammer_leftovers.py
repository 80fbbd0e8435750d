"""Hammer what ``detctx run`` commands leave behind, and nested blocks with a missing rank.

    python benchmarks/hammer_leftovers.py --trials 10 --launches 8

- leftovers: ``detctx run -n 2`` of a command that starts a grandchild living
  two minutes (in its group holding the output, in its group with the output
  redirected, a daemon: ``setsid`` after a double fork, holding the output) and
  exits; and of one whose ``setsid`` grandchild runs while ``detctx run`` gets
  SIGTERM. Counts grandchildren alive afterwards, runs that did not finish
  within 60 s, and the slowest run;
- nested: launches of ``tests/distributed_wait_worker.py`` (2 gloo ranks,
  ``timeout=1``, rank 1 missing from an inner block's entry or exit); counts
  scenarios where rank 0 waited out more than one timeout, and the longest
  wait (the documented bound is twice ``timeout``).

The figures are those quoted in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
GUARD_S = 60.0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def leftover_trial(mode: str, folder: Path) -> dict[str, Any]:
    sys.path.insert(0, str(TESTS))
    from test_cli_leftovers import COMMAND

    script, pids = folder / "command.py", folder / "pids"
    script.write_text(textwrap.dedent(COMMAND))
    pids.unlink(missing_ok=True)
    stop = mode == "setsid"
    command = [sys.executable, str(script), str(pids), mode]
    runner = subprocess.Popen(
        [sys.executable, "-m", "detctx", "run", "-n", "2", "--", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    started = time.monotonic()
    hung = False
    try:
        if stop:
            while not pids.exists() and time.monotonic() - started < GUARD_S:
                time.sleep(0.05)
            runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        seconds = time.monotonic() - started
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
        children = [int(line) for line in pids.read_text().split()] if pids.exists() else []
        left = [pid for pid in children if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return {"hung": hung, "left": len(left), "seconds": seconds}


def hammer_leftovers(trials: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("background", "redirected", "daemon", "setsid"):
            counts = {"trials": 0, "hung": 0, "left_alive": 0, "slowest_s": 0.0}
            for _ in range(trials):
                seen = leftover_trial(mode, Path(folder))
                counts["trials"] += 1
                counts["hung"] += seen["hung"]
                counts["left_alive"] += seen["left"]
                counts["slowest_s"] = round(max(counts["slowest_s"], seen["seconds"]), 2)
            results[mode] = counts
    return results


def hammer_nested(launches: int) -> dict[str, Any]:
    sys.path.insert(0, str(TESTS))
    from conftest import launch_ranks

    counts = {"launches": 0, "scenarios": 0, "waited_twice": 0, "failed": 0, "max_wait_s": 0.0}
    for _ in range(launches):
        counts["launches"] += 1
        try:
            ranks = launch_ranks(TESTS / "distributed_wait_worker.py", 2, timeout=150)
        except AssertionError:
            counts["failed"] += 1
            continue
        for name in ("entry", "exit"):
            seen = ranks[0][name]
            counts["scenarios"] += 1
            counts["waited_twice"] += seen["timeouts"] > 1
            counts["max_wait_s"] = max(counts["max_wait_s"], seen["seconds"])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="per leftover mode")
    parser.add_argument("--launches", type=int, default=8)
    args = parser.parse_args()
    results = {
        "leftovers": hammer_leftovers(args.trials),
        "nested": hammer_nested(args.launches),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
