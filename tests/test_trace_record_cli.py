"""``detctx record`` runs a command once and writes its trace, with no change to the script;
under torchrun each rank writes its own, and ``detctx compare`` names the rank where an
error starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def detctx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detctx", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_record_writes_a_trace_of_an_unchanged_script_and_compare_finds_the_change(
    tmp_path: Path,
) -> None:
    script = str(ROOT / "examples" / "across.py")
    first = detctx("record", "-o", str(tmp_path / "a.trace"), "--", sys.executable, script)
    assert first.returncode == 0, first.stderr
    assert first.stdout.endswith(f"trace written to {tmp_path / 'a.trace'}\n")
    again = detctx(
        "record",
        "-o",
        str(tmp_path / "b.trace"),
        "--",
        sys.executable,
        script,
        "--scale-layer",
        "0",
    )
    assert again.returncode == 0, again.stderr
    compared = detctx("compare", str(tmp_path / "a.trace"), str(tmp_path / "b.trace"), "--json")
    assert compared.returncode == 1, compared.stderr
    origin = json.loads(compared.stdout)["origin"]
    assert (origin["op"], origin["module_path"]) == ("aten::mul.Tensor", "GPT.h.0.mlp")
    # Another process, the same program: the same bits (the digest's key is the same in both).
    third = detctx("record", "-o", str(tmp_path / "c.trace"), "--", sys.executable, script)
    assert third.returncode == 0, third.stderr
    same = detctx("compare", str(tmp_path / "a.trace"), str(tmp_path / "c.trace"))
    assert same.returncode == 0 and "AGREE bit for bit" in same.stdout


@pytest.mark.slow
def test_a_command_that_starts_no_python_writes_no_trace(tmp_path: Path) -> None:
    result = detctx("record", "-o", str(tmp_path / "a.trace"), "--", "true")
    assert result.returncode == 2
    assert "wrote no trace" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_record_refuses_to_overwrite_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    result = detctx("record", "-o", str(precious), "--", sys.executable, "-c", "pass")
    assert result.returncode == 2 and "is not a trace detctx recorded" in result.stderr
    assert precious.read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_under_torchrun_each_rank_records_and_the_origin_names_rank_1(tmp_path: Path) -> None:
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(TESTS / "trace_ranks.py"),
    ]
    plain = detctx("record", "-o", str(tmp_path / "a"), "--", *launch)
    assert plain.returncode == 0, plain.stderr
    changed = detctx("record", "-o", str(tmp_path / "b"), "--", *launch, "--scale-rank", "1")
    assert changed.returncode == 0, changed.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["rank0.trace", "rank1.trace"]
    compared = detctx("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert compared.returncode == 1, compared.stderr
    result = json.loads(compared.stdout)
    assert result["origin"]["rank"] == 1
    assert result["origin"]["module_path"] == "GPT.h.1.mlp"
    same = detctx("compare", str(tmp_path / "a"), str(tmp_path / "a"))
    assert same.returncode == 0 and "bit for bit" in same.stdout


@pytest.mark.slow
def test_record_replaces_an_earlier_folder_of_rank_traces_only_when_it_holds_nothing_else(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "rank0.trace").write_bytes(b"DETCTXST" + bytes(8))
    (folder / "notes.txt").write_text("keep me")
    result = detctx("record", "-o", str(folder), "--", sys.executable, "-c", "pass")
    assert result.returncode == 2 and "notes.txt besides rank traces" in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "rank0.trace"]


@pytest.mark.slow
def test_a_command_whose_recorded_process_runs_no_op_is_refused_with_the_way_out(
    tmp_path: Path,
) -> None:
    # The first Python process (recorded) runs no torch op; the one it starts, which runs
    # the work (as torch.multiprocessing.spawn's ranks do), is not recorded.
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import subprocess, sys\n"
        "subprocess.run([sys.executable, '-c', 'import torch; print(torch.ones(3).sum())'],"
        " check=True)\n"
    )
    trace = tmp_path / "spawned.trace"
    done = detctx("record", "-o", str(trace), "--", sys.executable, str(launcher))
    assert done.returncode == 2
    assert f"{trace} holds no op" in done.stderr
    assert "torchrun" in done.stderr and "detctx.recording" in done.stderr
    assert "Traceback" not in done.stderr
    # A process that runs ops is recorded as before.
    worker = tmp_path / "worker.py"
    worker.write_text("import torch\nprint((torch.ones(3) * 2).sum())\n")
    again = detctx("record", "-o", str(tmp_path / "w.trace"), "--", sys.executable, str(worker))
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ending", "outcome"),
    [
        ("sys.exit(3)", "the command exited with status 3"),
        ("raise RuntimeError('Trying to resize storage')", "raised RuntimeError: Trying to"),
    ],
)
def test_recordings_of_a_failing_command_never_agree_even_with_each_other(
    ending: str, outcome: str, tmp_path: Path
) -> None:
    script = tmp_path / "fails.py"
    script.write_text(
        f"import sys, torch\ntorch.ones(4).mul(2).sum()\n{ending}\n", encoding="utf-8"
    )
    for name in ("a.trace", "b.trace"):
        done = detctx("record", "-o", str(tmp_path / name), "--", sys.executable, str(script))
        assert done.returncode == 2 and "the command exited with status" in done.stderr
    compared = detctx("compare", str(tmp_path / "a.trace"), str(tmp_path / "b.trace"), "--json")
    assert compared.returncode == 1, compared.stderr
    result = json.loads(compared.stdout)
    assert not result["agree"] and not result["bitwise"] and result["past_tolerance"] == []
    assert result["not_completed"]["A"].startswith(f"rank 0 {outcome}")
