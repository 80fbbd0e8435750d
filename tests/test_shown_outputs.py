"""What the pages show a command printing is what it prints, and the figures a page gives
about itself are what they count: none can drift from the code.

A console block with output carries a marker before it: ``<!-- output: exact -->`` (every
character checked) or ``<!-- output: numbers vary -->`` (decimal numbers, such as losses
drawn from OS entropy, stand for any number; integers such as op counts are checked). A
shown line ``...`` stands for any lines.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- output: (exact|numbers vary) -->\n```console\n")
DECIMAL = re.compile(r"[-+]?\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+")
NUMBER_WORDS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}


def console_blocks() -> list[tuple[Path, int, str, str, list[str]]]:
    """(page, line, how, command, shown output) of every console block that shows output."""
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for fence in re.finditer(r"```console\n(.*?)```", text, re.DOTALL):
            command, *shown = fence.group(1).rstrip("\n").split("\n")
            if not shown:
                continue
            before = text[: fence.start()].rsplit("\n\n", 1)[-1] + "```console\n"
            marker = MARKER.search(before)
            how = marker.group(1) if marker else "unmarked"
            line = text.count("\n", 0, fence.start()) + 1
            blocks.append((page, line, how, command.removeprefix("$ "), shown))
    return blocks


def masked(line: str, how: str) -> str:
    return DECIMAL.sub("<number>", line) if how == "numbers vary" else line


def shown_matches(shown: list[str], printed: list[str], how: str) -> bool:
    """Whether ``printed`` reads as ``shown``, a ``...`` line standing for any lines."""
    if not shown:
        return not printed
    if shown[0].strip() == "...":
        return any(shown_matches(shown[1:], printed[i:], how) for i in range(len(printed) + 1))
    return (
        bool(printed)
        and masked(shown[0], how) == masked(printed[0], how)
        and shown_matches(shown[1:], printed[1:], how)
    )


def first_python_example(page: Path) -> str:
    match = re.search(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)
    assert match is not None
    return match.group(1)


def test_every_console_block_that_shows_output_says_how_it_is_checked():
    blocks = console_blocks()

    assert len(blocks) >= 3, "the pages show no command's output: is the pattern still right?"
    assert [f"{p.name}:{line}" for p, line, how, _, _ in blocks if how == "unmarked"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "line", "how", "command", "shown"),
    console_blocks(),
    ids=[f"{page.name}:{line}" for page, line, *_ in console_blocks()],
)
def test_a_shown_output_is_what_the_command_prints(tmp_path, page, line, how, command, shown):
    words = shlex.split(command)
    cwd = ROOT
    if "train.py" in words:  # the page's script, saved as train.py as the page says
        cwd = tmp_path
        (tmp_path / "train.py").write_text(first_python_example(page))
    program = {"python": [sys.executable], "detctx": [sys.executable, "-m", "detctx"]}
    argv = [*program.get(words[0], [words[0]]), *words[1:]]
    argv = [sys.executable if word == "python" else word for word in argv]

    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)

    printed = done.stdout.rstrip("\n").split("\n")
    assert shown_matches(shown, printed, how), (
        f"{page.name}:{line} shows\n" + "\n".join(shown) + "\nbut it printed\n" + done.stdout
    )


def test_a_shown_line_of_dots_stands_for_any_lines_and_varying_numbers_for_any_number():
    assert shown_matches(["a", "...", "d"], ["a", "b", "c", "d"], "exact")
    assert shown_matches(["a", "...", "d"], ["a", "d"], "exact")
    assert not shown_matches(["a", "d"], ["a", "b", "d"], "exact")
    assert shown_matches(["op 21: 0.25 of 1e-05"], ["op 21: 0.5 of 3.2e-06"], "numbers vary")
    assert not shown_matches(["op 22: 0.25"], ["op 21: 0.25"], "numbers vary")
    assert not shown_matches(["loss 0.25"], ["loss 0.5"], "exact")


def test_the_op_the_pages_name_in_prose_is_the_op_their_checked_output_names():
    found = {
        page.name: set(re.findall(r"parted from run 1 at op (\d+), aten::div", page.read_text()))
        for page in PAGES
    }
    named = set().union(*found.values())

    assert len(named) == 1, found


def test_the_readme_says_how_long_it_is_as_wc_counts_it():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines, words = text.count("\n"), len(text.split())

    said = re.search(r"takes (\w+) minutes to read \((\d+) lines\)", text)
    figure = re.search(r"\| (\d+) lines, (\d+) words: about (\w+) minutes at 200 words", text)

    assert said is not None and figure is not None
    assert int(said.group(2)) == lines == int(figure.group(1))
    assert int(figure.group(2)) == words
    assert said.group(1) == figure.group(3) == NUMBER_WORDS[round(words / 200)]


def test_the_pages_name_one_machine_for_the_figures_measured_on_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")

    here = re.search(r"Measured on the development machine \(([^,]+?) under", readme)
    there = re.search(r"development machine: ([^,]+),", benchmarks)

    assert here is not None and there is not None
    assert here.group(1) == there.group(1)


def test_the_agreement_at_printed_precision_shown_is_what_the_verdict_prints():
    from detctx._cli.curves import Curve, Point, compare
    from detctx._cli.verdict import describe

    page = (ROOT / "docs" / "proving.md").read_text(encoding="utf-8")
    shown = re.search(r"```\n(2 curves agree at the printed precision.*?)\n```", page, re.DOTALL)
    texts = ["2.072", "2.051", "2.033", "2.010", "1.987", "1.966", "1.950", "1.932"]
    curve = Curve("run", tuple(Point(float(t), t, n, None) for n, t in enumerate(texts, 1)))

    assert shown is not None
    assert describe(compare([curve, Curve("run 2", curve.points)])) == shown.group(1)


def test_the_causes_the_pages_quote_are_what_the_verdict_says():
    from detctx._basics import EntryNote
    from detctx._cli.hints import different_start, exported_seed, noted_cause

    said = "\n".join(
        [
            noted_cause([None, None]),
            noted_cause([EntryNote(1, "argument", {"torch": t * 16}) for t in "ab"]),
            noted_cause([EntryNote(1, "argument", {}), EntryNote(1, "argument", {})]),
            different_start(1),
            exported_seed([EntryNote(1234, "environment", {})], 1234),
        ]
    )
    page = (ROOT / "docs" / "proving.md").read_text(encoding="utf-8")
    paragraph = page.split("Runs that differ from the very first point did not start", 1)[1]
    paragraph = paragraph.split("When the runs agree and the logs print", 1)[0]
    quoted = re.findall(r'"([^"]+)"', paragraph.replace("\n", " "))

    assert len(quoted) >= 5
    for quote in quoted:
        for part in quote.split(" ... "):
            assert part in said, part
