"""The ``detctx`` command: ``doctor``, ``run``, ``record``, ``compare`` and ``demo``.

Exit status: 0 when the curves agree (and for ``doctor``), 1 when they
differ, 2 on bad usage or when the curves could not be read (a missing file,
a log without metric lines, a command that failed). Expected failures are
one line on stderr, ``detctx: error: ...``, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detctx._basics import (
    DEFAULT_SEED,
    SEED_ENV,
    DetctxError,
    MetricsError,
    parse_seed,
    resolve_seed,
)
from detctx._cli.curves import (
    CurveComparison,
    compare,
    compile_pattern,
    no_points_message,
)
from detctx._cli.hints import FrameworkSigns
from detctx._cli.logs import read_curve
from detctx._cli.plot_target import check_plot_path
from detctx._cli.plotting import load_pyplot, plot
from detctx._cli.signals import Stopped, forwarded_signals, raise_pending
from detctx._cli.verdict import describe

__all__ = ["main"]

AGREE, DIFFER, USAGE = 0, 1, 2

STARTED = time.monotonic()
"""When the command started: this module is the console script's first import.

The process's own start time (``/proc/self/stat``) is not it: ``bash -c "pip
install ... && detctx demo"`` execs the command in the shell's process, which
started before the install."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(USAGE, f"{self.prog}: error: {message}\n")


def _seed_argument(text: str) -> int:
    try:
        return parse_seed(text, "--seed")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _runs_argument(text: str) -> int:
    try:
        runs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"-n takes a number of runs, got {text!r}") from None
    if runs < 2:
        raise argparse.ArgumentTypeError(f"-n must be at least 2 to compare anything, got {runs}")
    return runs


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("detctx")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="detctx",
        description="Prove PyTorch runs reproduce: check the environment, run a command "
        "twice and compare its loss curves, compare two logs; across machines, record a run "
        "on each and compare the traces op by op.",
        epilog="Exit status: 0 agree, 1 differ, 2 bad usage or unreadable curves.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"detctx {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    doctor = commands.add_parser(
        "doctor", help="versions, devices, determinism flags and variables, warnings"
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--probe",
        action="store_true",
        help="run ops known to be nondeterministic on some device, with determinism off and on",
    )
    doctor.add_argument(
        "--device", metavar="TYPE", action="append", help="with --probe: only this device type"
    )
    doctor.add_argument(
        "--diff",
        nargs=2,
        type=Path,
        metavar=("A.json", "B.json"),
        help="list the rows two machines' `detctx doctor --json` reports give differently, "
        "side by side (as `detctx compare A.json B.json` does)",
    )

    curve_options = _Parser(add_help=False)
    curve_options.add_argument(
        "--pattern",
        metavar="RE",
        help="regex for the metric; the number is the group named 'value', else group 1, "
        "else the whole match (default: the training loss of Megatron/MindSpeed, "
        "Lightning, HF Trainer and plain 'loss: x' lines)",
    )
    plot_option = _Parser(add_help=False)
    plot_option.add_argument(
        "--plot",
        metavar="FILE.png",
        type=Path,
        help="write the curves and their difference; the suffix names the format (.png, .pdf, "
        ".svg, ...); checked before anything runs",
    )

    run = commands.add_parser(
        "run",
        parents=[curve_options, plot_option],
        help="run a command several times with the determinism environment; compare curves",
        usage="detctx run [-n N] [--seed S] [--pattern RE] [--plot FILE.png] "
        "[--log-dir DIR] [-v] [--locate] -- CMD ...",
    )
    run.add_argument(
        "-n",
        "--runs",
        type=_runs_argument,
        default=2,
        metavar="N",
        help="how many runs (default 2)",
    )
    run.add_argument(
        "--seed",
        type=_seed_argument,
        metavar="S",
        help=f"the seed for every run (default ${SEED_ENV}, else {DEFAULT_SEED})",
    )
    run.add_argument(
        "--log-dir", type=Path, metavar="DIR", help="keep each run's output as DIR/runN.log"
    )
    run.add_argument("-v", "--verbose", action="store_true", help="show the command's output")
    run.add_argument(
        "--locate",
        action="store_true",
        help="record every op's digest in each run (Python commands) and name the first op "
        "where the runs part, with its module and source line",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    run.set_defaults(command_parser=run)

    compare_ = commands.add_parser(
        "compare",
        parents=[curve_options, plot_option],
        help="compare two recorded traces op by op (detctx record), two logs' curves (text, "
        "Lightning metrics.csv, HF trainer_state.json), or two machines' doctor --json reports",
        description="Compare two runs. Traces (detctx record -o A.trace -- CMD, on each machine "
        "or release): the first op whose error its inputs do not explain, with its module, "
        "source line and rank; --rtol, --atol, --json and --plot apply. Metric logs: the loss "
        "curves point by point, bit for bit or at the printed precision. Doctor reports "
        "(detctx doctor --json > A.json): every row that differs, side by side.",
    )
    compare_.add_argument(
        "logs",
        nargs=2,
        type=Path,
        metavar="LOG",
        help="a trace or a folder of rank traces written by detctx record; a text log (read "
        "with --pattern; colour codes ignored), a Lightning metrics.csv, a Hugging Face "
        "trainer_state.json or a folder holding one of those two; or a detctx doctor --json "
        "report. Both of one kind",
    )
    compare_.add_argument(
        "--metric",
        metavar="NAME",
        help="a metrics.csv column, a trainer_state.json log_history key, or the name before "
        "':', '=' or a space in a text log (default: the training loss)",
    )
    from detctx._cli.record import add_arguments

    add_arguments(commands, compare_)

    commands.add_parser(
        "demo",
        parents=[plot_option],
        help="train a small model twice and show the curves agree",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``detctx`` command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return _doctor(args)
        if getattr(args, "plot", None) is not None:
            load_pyplot()
            check_plot_path(args.plot)
        if args.command == "demo":
            from detctx._cli import demo

            return demo.main(plot_path=args.plot, since=STARTED)
        if args.command in ("record", "compare"):
            from detctx._cli.record import dispatch

            status = dispatch(args)
            if status is not None:
                return status
        if args.command == "compare":
            from detctx._cli.doctor_diff import doctor_reports

            reports = doctor_reports(args.logs)
            if reports is not None:
                return _doctor_diff(reports, args.logs)
        pattern = compile_pattern(args.pattern)
        if args.command == "compare":
            curves = [read_curve(p, pattern=args.pattern, metric=args.metric) for p in args.logs]
            return _report(compare(curves), args.plot, _metric_name(args), one_environment=False)
        with forwarded_signals():
            return _run(args.command_parser, args, pattern)
    except (DetctxError, ValueError, OSError) as exc:
        sys.stderr.write(f"detctx: error: {exc}\n")
        return USAGE
    except MemoryError:
        # Uncaught, it ended the process with status 1, which says "the curves differ".
        sys.stderr.write("detctx: error: out of memory reading the curves\n")
        return USAGE
    except KeyboardInterrupt:
        sys.stderr.write("detctx: interrupted\n")
        return 130
    except Stopped as stopped:
        sys.stderr.write(f"detctx: {stopped}; the command was stopped too\n")
        return 128 + stopped.signum


def _doctor(args: argparse.Namespace) -> int:
    if args.diff is not None:
        if args.probe or args.json or args.device:
            raise ValueError("--diff compares two saved reports: give it alone")
        from detctx._cli.doctor_diff import read_report

        return _doctor_diff([read_report(path) for path in args.diff], args.diff)
    if args.probe:
        from detctx._cli import probe

        return probe.main(args.device, as_json=args.json)
    if args.device:
        raise ValueError("--device chooses the devices of --probe: add --probe")
    from detctx._proving import diagnose

    diagnosis = diagnose(read_device_names=True)
    if args.json:
        print(json.dumps(diagnosis.as_dict(), indent=2, default=str))
    else:
        print(diagnosis.format())
    return AGREE


def _doctor_diff(reports: list[dict[str, Any]], paths: Sequence[Path]) -> int:
    from detctx._cli.curves import short_names
    from detctx._cli.doctor_diff import compare_reports

    text, agree = compare_reports(reports, short_names([str(path) for path in paths]))
    print(text)
    return AGREE if agree else DIFFER


def _run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, pattern: re.Pattern[str]
) -> int:
    from detctx._cli.hints import exported_seed, noted_cause
    from detctx._cli.run import (
        RunNotes,
        determinism_env,
        determinism_variables,
        log_file,
        run_command,
    )

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("run needs a command after --, e.g. detctx run -- python train.py")
    exported_here = bool(os.environ.get(SEED_ENV, "").strip())
    if args.seed is not None:
        seed = args.seed
    elif exported_here:
        seed = resolve_seed(None)
    else:
        seed = DEFAULT_SEED
    env = determinism_env(seed, os.environ)
    shown = " ".join(f"{name}={env[name]}" for name in determinism_variables())
    sys.stderr.write(f"detctx run: {args.runs} runs of {shlex.join(command)}\n  with {shown}\n")
    logs = [log_file(args.log_dir, index) for index in range(1, args.runs + 1)]
    tracing = None
    if args.locate:
        from detctx._cli.locate import Tracing

        tracing = Tracing.start(args.log_dir)
        tracing.check(args.runs)
    notes = RunNotes(args.runs)
    curves = []
    for index in range(1, args.runs + 1):
        raise_pending()
        signs = FrameworkSigns()
        run_env = env if tracing is None else tracing.env_for(index, env)
        curve = run_command(
            command,
            notes.env_for(index, run_env),
            pattern,
            f"run {index}",
            log_path=logs[index - 1],
            echo=args.verbose,
            watch=signs.feed,
        )
        if not curve.points and tracing is None:
            raise MetricsError(
                no_points_message(f"the output of run {index}", pattern, signs.advice())
            )
        curves.append(curve)
    noted = notes.read()
    # A seed exported in the user's own shell reaches plain runs too: nothing to warn of.
    told = "" if exported_here else exported_seed(noted, seed)
    what = _metric_name(args)
    if tracing is not None:
        # The op traces give the diagnosis (the runs started apart, or where they parted):
        # the curves' verdict adds no causes of its own.
        return tracing.report(
            curves, lambda comparison: _report(comparison, args.plot, what, start="", notes=told)
        )
    return _report(compare(curves), args.plot, what, cause=noted_cause(noted), notes=told)


def _metric_name(args: argparse.Namespace) -> str:
    """What the curves are, for the plot's axis and title."""
    metric: str | None = getattr(args, "metric", None)
    if metric is not None:
        return metric
    return "training loss" if args.pattern is None else "metric"


def _report(
    comparison: CurveComparison,
    plot_path: Path | None,
    what: str,
    *,
    start: str | None = None,
    cause: str = "",
    notes: str = "",
    one_environment: bool = True,
) -> int:
    print(
        describe(comparison, start=start, cause=cause, notes=notes, one_environment=one_environment)
    )
    verdict = AGREE if comparison.agree else DIFFER
    if plot_path is not None:
        try:
            plot(comparison, plot_path, what)
        except (DetctxError, ValueError, OSError) as exc:
            # The path was checked up front; if it broke since, the verdict still stands.
            sys.stderr.write(f"detctx: error: the plot could not be written: {exc}\n")
            return verdict
        print(f"plot written to {plot_path}")
    return verdict
