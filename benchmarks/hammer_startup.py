"""Ctrl-C in the first second of ``detctx run``: count the runs that went ahead anyway.

    python benchmarks/hammer_startup.py --trials 80

Each trial starts ``detctx run`` (two runs) of a command that prints one
loss and ends at once, and sends SIGINT to ``detctx run`` after a random
delay in ``[0, --within)`` seconds. A signal is *lost* when ``detctx run``
then exits other than by it (130, or -2 when the signal came before Python
could handle it): it went on and ran the command anyway. Trials where both
runs had finished before the signal came (status 0, and it came after the
second command had started) are counted apart. The figures are those quoted
in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

COMMAND = "import sys, time; open(sys.argv[1], 'a').write(f'{time.time()}\\n'); print('loss: 1')"


def trial(folder: Path, delay: float) -> tuple[str, int]:
    started = folder / "started"
    started.unlink(missing_ok=True)
    runner = subprocess.Popen(
        [sys.executable, "-m", "detctx", "run", "--", sys.executable, "-c", COMMAND, str(started)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # A shell's background job starts with SIGINT ignored; detctx run keeps it so.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(delay)
    sent = time.time()
    runner.send_signal(signal.SIGINT)
    status = runner.wait(timeout=120)
    starts = [float(line) for line in started.read_text().split()] if started.exists() else []
    if status in (130, -signal.SIGINT):
        return "stopped", status
    if status == 0 and len(starts) == 2 and starts[1] < sent:
        return "too late", status
    return "lost", status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=80)
    parser.add_argument("--within", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.trials):
            outcome, status = trial(Path(folder), rng.uniform(0.0, args.within))
            outcomes[outcome] += 1
            statuses[status] += 1
    print(
        f"trials: {args.trials}, lost: {outcomes['lost']}, stopped: {outcomes['stopped']}, "
        f"finished before the signal: {outcomes['too late']}, "
        f"exit statuses: {dict(sorted(statuses.items()))}"
    )


if __name__ == "__main__":
    main()
