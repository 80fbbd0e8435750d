"""``detctx run``'s verdict when runs part at the start or agree only through the seed it
exports: one diagnosis, from the op traces when recorded, else from what the runs told it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import detctx
from detctx import _cli as cli
from detctx._basics import NOTES_ENV, SEED_ENV, EntryNote, note_entry, read_entry_note, run_notes
from detctx._cli.curves import Curve, Point, compare
from detctx._cli.hints import exported_seed, noted_cause
from detctx._cli.verdict import describe

ROOT = Path(__file__).resolve().parents[1]

SEEDED_BY_DETCTX_RUN_ONLY = """\
import torch, detctx
with detctx.deterministic(seed=None):
    print(f"loss: {torch.randn(()).item():.9g}")
"""

DISTRIBUTED_BLOCK_SEEDED_BY_DETCTX_RUN_ONLY = """\
import torch, detctx
with detctx.distributed_deterministic(seed=None, per_rank=True):
    print(f"loss: {torch.randn(()).item():.9g}")
"""

MODEL_BUILT_BEFORE_THE_BLOCK = """\
import torch, detctx
model = torch.nn.Linear(3, 1)
with detctx.deterministic(seed=1):
    print(f"loss: {model(torch.ones(3)).item():.9g}")
    print(f"loss: {model(torch.zeros(3)).item():.9g}")
"""

UNSEEDED_GENERATOR_IN_THE_BLOCK = """\
import numpy as np, detctx
with detctx.deterministic(seed=1):
    rng = np.random.default_rng()
    print(f"loss: {rng.random():.9g}")
    print(f"loss: {rng.random():.9g}")
"""

NO_DETCTX = """\
import random
print(f"loss: {random.random():.9g}")
print(f"loss: {random.random():.9g}")
"""


def one_point(name: str, value: float) -> Curve:
    return Curve(name, (Point(value, repr(value), 1, None),))


def run_script(tmp_path: Path, source: str, *extra: str) -> tuple[int, str]:
    script = tmp_path / "train.py"
    script.write_text(source)
    status = cli.main(["run", *extra, "--", sys.executable, str(script)])
    return status, ""


@pytest.mark.slow
def test_a_located_run_gives_the_op_traces_diagnosis_alone(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)

    status = cli.main(["run", "--locate", "--", sys.executable, "examples/locate.py", "--train"])

    out = capsys.readouterr().out
    assert status == 1
    assert "op traces: Run 2 parted from run 1 at op" in out
    # no second diagnosis that contradicts the traces: they say the runs started alike
    assert "did not start from the same state" not in out
    assert "Likely causes" not in out and "from the first point on" not in out


def test_a_one_point_log_is_not_said_to_differ_from_the_first_point_on():
    text = describe(compare([one_point("run 1", 0.5), one_point("run 2", 0.6)]))

    assert "from the first point on" not in text
    assert "differ at their only metric value" in text
    assert "detctx run --locate` names the first op" in text


def test_a_verdict_told_to_add_nothing_at_the_start_adds_no_causes():
    # what detctx run --locate asks for: its op traces give the diagnosis
    text = describe(compare([one_point("run 1", 0.5), one_point("run 2", 0.6)]), start="")

    assert "Likely causes" not in text and "did not start" not in text
    assert text.endswith("max abs difference 0.1.")


@pytest.mark.slow
@pytest.mark.parametrize(
    "source",
    [SEEDED_BY_DETCTX_RUN_ONLY, DISTRIBUTED_BLOCK_SEEDED_BY_DETCTX_RUN_ONLY],
    ids=["deterministic", "distributed_deterministic"],
)
def test_runs_seeded_only_by_the_exported_seed_agree_and_are_told_plain_runs_will_not(
    tmp_path, capsys, monkeypatch, source
):
    monkeypatch.delenv(SEED_ENV, raising=False)

    run_script(tmp_path, source)

    out = capsys.readouterr().out
    assert "2 curves agree bit for bit" in out
    assert "took their seed from DETCTX_SEED=1234, which detctx run exports" in out
    assert "plain runs will not reproduce" in out


@pytest.mark.slow
def test_a_seed_the_user_exported_is_no_cause_for_a_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(SEED_ENV, "77")

    run_script(tmp_path, SEEDED_BY_DETCTX_RUN_ONLY)

    out = capsys.readouterr().out
    assert "2 curves agree bit for bit" in out and "exports" not in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "cause"),
    [
        (MODEL_BUILT_BEFORE_THE_BLOCK, "after drawing from torch's global generator"),
        (UNSEEDED_GENERATOR_IN_THE_BLOCK, "a generator detctx does not seed"),
        (NO_DETCTX, "No run entered a detctx block or called detctx.seed_all"),
    ],
    ids=["model before the block", "unseeded generator", "no detctx"],
)
def test_runs_that_start_apart_are_told_the_one_cause_detctx_can_tell(
    tmp_path, capsys, source, cause
):
    status, _ = run_script(tmp_path, source)

    out = capsys.readouterr().out
    assert status == 1
    assert cause in out
    assert "Likely causes" not in out
    assert "`detctx run --locate` names the first op" in out


def note(seed: int = 1, seed_from: str = "argument", **drawn: str) -> EntryNote:
    return EntryNote(seed, seed_from, drawn)


def test_the_cause_from_notes_is_said_only_when_the_notes_tell_it():
    assert noted_cause([]) == ""
    assert noted_cause([note(), None]) == ""  # one run told nothing: no telling
    assert "different seeds (1, 2)" in noted_cause([note(1), note(2)])
    apart = noted_cause(
        [note(torch="a" * 16, numpy="1" * 16), note(torch="b" * 16, numpy="2" * 16)]
    )
    assert "torch's global generator and NumPy's global generator, which were" in apart
    # the same draws before the block in both runs (a seeded stream): not the cause
    assert "does not seed" in noted_cause([note(torch="a" * 16), note(torch="a" * 16)])


def test_the_exported_seed_is_named_only_when_a_run_read_it():
    assert exported_seed([note(), note()], 1234) == ""
    assert "DETCTX_SEED=1234" in exported_seed([note(seed_from="environment"), None], 1234)


def test_a_run_notes_its_first_block_once_into_the_file_the_parent_made(tmp_path, monkeypatch):
    path = tmp_path / "run1.notes"
    path.touch()
    monkeypatch.setenv(NOTES_ENV, str(path))
    monkeypatch.setenv(SEED_ENV, "5")
    monkeypatch.setattr(run_notes, "_noted_in", None)

    note_entry(5, given=False)
    note_entry(6, given=True)

    assert len(path.read_text().splitlines()) == 1
    read = read_entry_note(path)
    assert read is not None and (read.seed, read.seed_from) == (5, "environment")


@pytest.mark.parametrize("seed", [None, 9])
def test_a_distributed_block_notes_the_seed_the_ranks_agreed_on_before_seeding(
    tmp_path, monkeypatch, seed
):
    path = tmp_path / "run1.notes"
    path.touch()
    monkeypatch.setenv(NOTES_ENV, str(path))
    monkeypatch.setenv(SEED_ENV, "5")
    monkeypatch.setattr(run_notes, "_noted_in", None)

    with detctx.distributed_deterministic(seed=seed, per_rank=True) as seeding:
        shared = seeding.shared_seed

    read = read_entry_note(path)
    assert read is not None
    assert (read.seed, read.seed_from) == (shared, "environment" if seed is None else "argument")
    assert shared == (5 if seed is None else 9)
    assert read.block == "distributed_deterministic"
    told = exported_seed([read], shared)
    if seed is None:
        assert "distributed_deterministic(seed=None) draws a fresh seed" in told
        assert "distributed_deterministic(seed=5)" in told
        assert "deterministic(seed=None) (or seed_all())" not in told
    else:
        assert told == ""


def test_a_one_process_block_is_named_in_the_exported_seed_note():
    told = exported_seed([note(seed_from="environment")], 7)
    assert "`python train.py`, deterministic(seed=None) (or seed_all()) draws" in told
    assert "distributed" not in told


@pytest.mark.parametrize("block", ["", "seed_all", 1, None])
def test_a_note_naming_no_known_block_is_not_read(tmp_path, block):
    path = tmp_path / "run.notes"
    line = {"seed": 3, "seed_from": "fresh", "drawn": {}, "block": block}
    path.write_text(json.dumps(line) + "\n")
    assert read_entry_note(path) is None


def test_a_run_never_creates_a_notes_file_nor_writes_through_a_link(tmp_path, monkeypatch):
    monkeypatch.setattr(run_notes, "_noted_in", None)
    monkeypatch.setenv(NOTES_ENV, str(tmp_path / "absent.notes"))
    note_entry(1, given=True)
    assert not (tmp_path / "absent.notes").exists()

    target = tmp_path / "target"
    target.write_text("")
    (tmp_path / "link.notes").symlink_to(target)
    monkeypatch.setattr(run_notes, "_noted_in", None)
    monkeypatch.setenv(NOTES_ENV, str(tmp_path / "link.notes"))
    note_entry(1, given=True)
    assert target.read_text() == ""


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        json.dumps({"seed": -1, "seed_from": "argument", "drawn": {}}),
        json.dumps({"seed": 2**32, "seed_from": "argument", "drawn": {}}),
        json.dumps({"seed": True, "seed_from": "argument", "drawn": {}}),
        json.dumps({"seed": 1, "seed_from": "shell", "drawn": {}}),
        json.dumps({"seed": 1, "seed_from": "argument", "drawn": {"os": "0" * 16}}),
        json.dumps({"seed": 1, "seed_from": "argument", "drawn": {"torch": "zz" * 8}}),
        json.dumps({"seed": 1, "seed_from": "argument", "drawn": {}, "extra": 1}),
        "[" * 10_000,
    ],
    ids=lambda line: line[:40],
)
def test_a_notes_line_that_is_not_exactly_a_note_is_skipped(tmp_path, line):
    path = tmp_path / "run1.notes"
    good = json.dumps({"seed": 3, "seed_from": "fresh", "drawn": {"torch": "0123456789abcdef"}})
    path.write_text(line + "\n" + good + "\n")

    assert read_entry_note(path) == EntryNote(3, "fresh", {"torch": "0123456789abcdef"})


def test_a_notes_file_too_long_or_missing_reads_as_no_note(tmp_path):
    path = tmp_path / "run1.notes"
    path.write_text(
        "x" * 70_000 + "\n" + json.dumps({"seed": 3, "seed_from": "fresh", "drawn": {}})
    )

    assert read_entry_note(path) is None
    assert read_entry_note(tmp_path / "absent") is None
    assert os.environ.get(NOTES_ENV) is None  # the test process itself is no run
