"""Hammer the edges of ``detctx run``, seed agreement and seed text; print what was lost.

    python benchmarks/hammer_edges.py --signal-trials 60 --launches 10 --texts 100000

- signals: ``detctx run -n 3`` of a command that starts a grandchild and
  sleeps, stopped by SIGTERM, SIGHUP or SIGINT after a random delay (during
  start-up, a run, or between runs); counts processes of the command left
  alive afterwards and exit statuses other than 128 + the signal;
- ranks: gloo launches on loopback where the odd ranks never enter a block
  (``timeout=1``) and rank 1 raises inside a ``verify=True`` block; counts
  waiting ranks that hung, named the wrong ranks or were told the wrong thing;
- seed text: random strings through ``parse_seed`` against the documented rule.

The figures are those quoted in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

COMMAND = """
import subprocess, sys, time
token = sys.argv[1]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
print("step 1 loss: 1.0", flush=True)
time.sleep(float(sys.argv[2]))
print("step 2 loss: 0.5", flush=True)
"""


def processes_with(token: str, besides: int) -> list[int]:
    """Pids of live processes (zombies excluded) whose command line holds ``token``,
    other than ``besides`` (``detctx run`` itself, whose arguments hold it too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == besides:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def hammer_signals(trials: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    signals = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]
    counts: dict[str, Any] = {"trials": trials, "orphans": 0, "hung": 0, "unexpected": []}
    counts["after_start"] = {}
    counts["while_starting"] = {}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "command.py")
        script.write_text(textwrap.dedent(COMMAND))
        for trial in range(trials):
            token = f"detctx-hammer-{uuid.uuid4().hex}"
            signum = signals[trial % len(signals)]
            command = [sys.executable, str(script), token, "0.4"]
            runner = subprocess.Popen(
                [sys.executable, "-m", "detctx", "run", "-n", "3", "--", *command],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if trial % 4 == 0:
                time.sleep(rng.uniform(0.0, 1.0))  # often still starting up
            else:
                # After the first command has started: during a run or between runs.
                deadline = time.monotonic() + 60
                while not processes_with(token, runner.pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 2.0))
            started = bool(processes_with(token, runner.pid)) or runner.poll() is not None
            runner.send_signal(signum)
            try:
                status = runner.wait(timeout=60)
            except subprocess.TimeoutExpired:
                runner.kill()
                status = runner.wait()
                counts["hung"] += 1
            time.sleep(0.2)
            left = processes_with(token, runner.pid)
            counts["orphans"] += len(left)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            key = f"{signal.Signals(signum).name} -> {status}"
            where = counts["after_start" if started else "while_starting"]
            where[key] = where.get(key, 0) + 1
            # Once a command has started: 128 + signal, or 0 when every run had finished
            # before the signal came.
            if started and status not in (128 + signum, 0):
                counts["unexpected"].append(key)
    return counts


def rank_main(rank: int, world: int, port: int, out: str, timeout: float) -> None:
    import torch.distributed as dist

    import detctx

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    seen: dict[str, Any] = {}
    try:
        with detctx.distributed_deterministic(seed=3, verify=True):
            if rank == 1:
                raise ValueError("a bad batch")
    except ValueError:
        seen["raised"] = "own"
    except detctx.SeedAgreementError as exc:
        seen["raised"] = sorted(exc.failed.items())
    group = dist.new_group(backend="gloo")
    if rank % 2:
        time.sleep(4 * timeout + 2)
    else:
        started = time.monotonic()
        try:
            with detctx.distributed_deterministic(seed=3, group=group, timeout=timeout):
                seen["missing"] = "entered"
        except detctx.SeedAgreementError as exc:
            seen["missing"] = list(exc.missing or ())
        seen["waited"] = time.monotonic() - started
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)


def hammer_ranks(launches: int, timeout: float) -> dict[str, Any]:
    import torch.distributed as dist

    counts: dict[str, Any] = {"launches": 0, "waiting_ranks": 0, "wrong": 0, "max_wait_s": 0.0}
    context = multiprocessing.get_context("fork")
    for world in (2, 4):
        for _ in range(launches):
            store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            with tempfile.TemporaryDirectory() as out:
                ranks = [
                    context.Process(target=rank_main, args=(r, world, store.port, out, timeout))
                    for r in range(world)
                ]
                for process in ranks:
                    process.start()
                for process in ranks:
                    process.join(timeout=120)
                    if process.is_alive():
                        process.kill()
                counts["launches"] += 1
                missing = [r for r in range(world) if r % 2]
                for rank in range(world):
                    path = Path(out, f"rank{rank}.json")
                    if not path.exists():
                        counts["wrong"] += 1
                        continue
                    seen = json.loads(path.read_text())
                    told = "own" if rank == 1 else [[1, "ValueError"]]
                    ok = seen.get("raised") == told
                    if rank % 2 == 0:
                        counts["waiting_ranks"] += 1
                        ok = ok and seen.get("missing") == missing
                        counts["max_wait_s"] = max(counts["max_wait_s"], seen["waited"])
                    counts["wrong"] += not ok
    counts["max_wait_s"] = round(counts["max_wait_s"], 2)
    return counts


def hammer_seed_text(count: int, seed: int) -> dict[str, Any]:
    from detctx._basics.seeds import MAX_SEED, parse_seed

    rng = random.Random(seed)
    # ASCII digits, separators and signs, Arabic-Indic and fullwidth digits, letters.
    alphabet = "0123456789" * 4 + " \t_+-x\u0663\u0661\uff10\u00e9\n" + "abc"
    wrong = accepted = 0
    for _ in range(count):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        match = re.fullmatch(r"[ \t\r\n]*([0-9]+)[ \t\r\n]*", text, re.ASCII)
        expected = int(match.group(1)) if match and int(match.group(1)) <= MAX_SEED else None
        try:
            got: int | None = parse_seed(text)
            accepted += 1
        except ValueError:
            got = None
        wrong += got != expected
    return {"texts": count, "accepted": accepted, "wrong": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signal-trials", type=int, default=60)
    parser.add_argument("--launches", type=int, default=10, help="per world size (2 and 4)")
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--texts", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {
        "seed_text": hammer_seed_text(args.texts, args.seed),
        "ranks": hammer_ranks(args.launches, args.timeout),
        "signals": hammer_signals(args.signal_trials, args.seed),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
