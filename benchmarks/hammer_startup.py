"""Ctrl-C in the first second of ``detctx run``: count the runs that went ahead anyway.

    python benchmarks/hammer_startup.py --trials 80

Each trial starts ``detctx run`` (two runs) of a command that writes the
time it starts and prints one loss, and sends SIGINT to ``detctx run`` after
a random delay in ``[0, --within)`` seconds. The signal is *lost* when
``detctx run`` then exits 0 although a command started after the signal was
sent: it went on and ran the command anyway. It *stopped* the run when the
exit status is anything else (130; -2 when it came before Python could
handle it; 1 when it interrupted Python's own start-up, ``site``); trials
where both runs had finished before the signal came are counted apart. The
figures are those quoted in docs/reliability.md.
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
    if status != 0:
        return "stopped", status
    return ("lost" if any(start > sent for start in starts) else "too late"), status


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
