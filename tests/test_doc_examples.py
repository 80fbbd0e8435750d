"""Every Python example in README.md and docs/*.md runs as written.

The examples are read from the Markdown at collection time, so a page added
to docs/ is covered without a change here, and an example cannot drift from
what the test runs. The line before an example's fence may say how to run it:

    <!-- example: fragment, reproduces -->

- ``fragment``: it uses names from your code (``model``, ``loader``,
  ``train``, ...); it runs after ``examples/docs_preamble.py``, which defines them.
- ``continues``: it goes on from the page's previous example (run together).
- ``reproduces``: it prints what must repeat; it runs in two processes and
  what it printed must be the same in both.
- ``pytest``: it is a test file; pytest runs it.
- ``torchrun``: it runs on two gloo ranks under ``torchrun --standalone``.
- ``needs cuda`` / ``needs npu``: it runs only where that device is; ``needs
  several nodes`` and ``needs your ...`` (something only a user has: a
  training loop, a Trainer, Megatron's parallel groups) never run here, and
  the reason names the test that runs the same recipe. These are the only
  examples skipped, each with its reason.

An example without a marker is a complete script. The examples run in one
process per kind (plain, repeated, lightning, transformers, pytest; one
torchrun launch per distributed example), each in its own namespace from a
fresh RNG state (``doc_example_runner.py``), so that torch and each framework
are imported once per group.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch
from conftest import ROOT, TESTS

pytestmark = pytest.mark.usefixtures("one_launch_at_a_time")

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNER = TESTS / "doc_example_runner.py"
PREAMBLE = ROOT / "examples" / "docs_preamble.py"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`]*)$")
_MARK = re.compile(r"^\s*<!--\s*example:\s*(?P<words>.*?)\s*-->\s*$")
_WORDS = {"fragment", "continues", "reproduces", "pytest", "torchrun"}
_NEVER_HERE = ("several nodes", "your ")


@dataclass(frozen=True)
class Example:
    """A Python example: where it is, its code (with what it continues), how it runs."""

    page: str
    line: int
    code: str
    words: frozenset[str]
    needs: str | None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        for kind in ("pytest", "torchrun"):
            if kind in self.words:
                return kind
        for framework in ("lightning", "transformers"):
            if re.search(rf"^\s*(from|import) {framework}\b", self.code, re.MULTILINE):
                return framework
        return "repeated" if "reproduces" in self.words else "plain"


def read_examples(page: Path) -> list[Example]:
    """The ``python`` fences of ``page``, dedented, with the marker before each."""
    examples: list[Example] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if _FENCE.match(lines[i]))
        if fence.group("info").strip() == "python":
            indent = len(fence.group("indent"))
            code = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
            examples.append(_example(page, index + 1, code, _marker(lines, index), examples))
        index = end + 1
    return examples


def _marker(lines: list[str], fence: int) -> list[str]:
    before = fence - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    mark = _MARK.match(lines[before]) if before >= 0 else None
    if mark is None:
        return []
    words = mark.group("words")
    needs = words.find("needs ")
    # "needs ..." runs to the end of the marker: its reason may hold commas
    head, tail = (words, "") if needs < 0 else (words[:needs], words[needs:])
    return [word.strip() for word in [*head.split(","), tail] if word.strip()]


def _example(page: Path, line: int, code: str, words: list[str], before: list[Example]) -> Example:
    needs = next((word[len("needs ") :] for word in words if word.startswith("needs ")), None)
    plain = {word for word in words if not word.startswith("needs ")}
    unknown = plain - _WORDS
    if unknown:
        raise ValueError(f"{page.name}:{line}: unknown example marker {sorted(unknown)}")
    if "continues" in plain:
        previous = before[-1]
        code = previous.code + code
        plain |= previous.words & {"fragment"}
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
    return Example(name, line, code, frozenset(plain), needs)


def available(needs: str) -> bool:
    """Whether an example that needs ``needs`` can run on this machine."""
    if needs == "cuda":
        return torch.cuda.is_available()
    if needs == "npu":
        return hasattr(torch, "npu") and torch.npu.is_available()
    return False


EXAMPLES = [example for page in PAGES for example in read_examples(page)]
SKIPPED = [e for e in EXAMPLES if e.needs is not None and not available(e.needs)]
GROUPS: dict[str, list[Example]] = {}
for _one in EXAMPLES:
    if _one not in SKIPPED:
        # A second init_process_group under the same torchrun can meet the first
        # group's keys in torchrun's store and wait forever: one launch each.
        key = f"torchrun {_one.name}" if _one.kind == "torchrun" else _one.kind
        GROUPS.setdefault(key, []).append(_one)


def _run(group: list[Example], folder: Path) -> dict[str, dict[str, str | None]]:
    """Run ``group`` in one process (two ranks under torchrun); what each example printed."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "examples.json"
    spec.write_text(
        json.dumps(
            [{"name": e.name, "code": e.code, "preamble": "fragment" in e.words} for e in group]
        )
    )
    out = folder / "results.json"
    command = [sys.executable, str(RUNNER), str(spec), str(out)]
    if group[0].kind == "torchrun":
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = _child(command, folder)
    files = sorted(folder.glob("results.json*"))
    assert files, f"the runner wrote nothing\n{proc.stdout}\n{proc.stderr}"
    results: dict[str, dict[str, str | None]] = {}
    for file in files:
        for result in json.loads(file.read_text()):
            results[f"{result['name']}{file.suffix if file.suffix != '.json' else ''}"] = result
    ran = {name.split(".rank")[0] for name in results}
    assert ran == {e.name for e in group}, f"{proc.stdout}\n{proc.stderr}"
    return results


def _child(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``command``; after 300 s its whole process group (torchrun's ranks too) is killed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        pytest.fail(f"{' '.join(command)} ran for 300 s\n{out}\n{err}")
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def _pytest(group: list[Example], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for example in group:
        preamble = PREAMBLE.read_text() if "fragment" in example.words else ""
        page = re.sub(r"\W", "_", Path(example.page).stem)
        (folder / f"test_{page}_{example.line}.py").write_text(preamble + example.code)
    proc = _child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)], folder
    )
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert proc.returncode == 0 and passed is not None, proc.stdout + proc.stderr
    assert int(passed.group(1)) >= len(group), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_example_runs_as_written_and_what_it_prints_repeats(
    group: str, tmp_path: Path
) -> None:
    examples = GROUPS[group]
    if examples[0].kind == "pytest":
        _pytest(examples, tmp_path)
        return
    first = _run(examples, tmp_path / "first")
    assert {name: r["error"] for name, r in first.items() if r["error"]} == {}
    repeating = {e.name for e in examples if "reproduces" in e.words}
    if not repeating:
        return
    second = _run(examples, tmp_path / "second")
    assert {name: r["error"] for name, r in second.items() if r["error"]} == {}
    for name, result in first.items():
        if name.split(".rank")[0] in repeating:
            assert result["stdout"], f"{name} is marked 'reproduces' but prints nothing"
            assert result["stdout"] == second[name]["stdout"], f"{name} printed other output"


@pytest.mark.parametrize("example", SKIPPED, ids=lambda example: example.name)
def test_an_example_that_needs_what_this_machine_lacks_is_skipped_with_its_reason(
    example: Example,
) -> None:
    assert example.needs in ("cuda", "npu") or example.needs.startswith(_NEVER_HERE)
    pytest.skip(f"{example.name} needs {example.needs}")


def test_the_examples_are_found_and_hardly_any_is_skipped() -> None:
    assert len(EXAMPLES) >= 30
    never_here = [e.name for e in EXAMPLES if e.needs and not e.needs.startswith(("cuda", "npu"))]
    assert len(never_here) <= 8, f"examples that cannot run anywhere in CI: {never_here}"
    # each says which test runs the same recipe with what the user would have built
    for example in EXAMPLES:
        if example.needs and example.needs.startswith("your "):
            named = re.findall(r"tests/\w+\.py", example.needs)
            assert named and all((ROOT / path).is_file() for path in named), example.name
    # The README opens with a complete script (no preamble) that reproduces as written.
    quickstart = next(e for e in EXAMPLES if e.page == "README.md")
    assert quickstart.words == {"reproduces"} and quickstart.kind == "repeated"


def test_the_preamble_seeds_nothing_so_a_reproducing_example_must_seed_itself() -> None:
    calls = {
        node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for node in ast.walk(ast.parse(PREAMBLE.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call)
    }
    seeding = {"deterministic", "seed_all", "manual_seed", "seed", "manual_seed_all"}
    assert calls & seeding == set()


@pytest.mark.slow
def test_a_fragment_that_trains_a_model_built_before_its_block_does_not_reproduce(
    tmp_path: Path,
) -> None:
    # What the headline once read: the model and loader come from the preamble, built
    # before the block as a user would, so two processes train from other weights.
    code = "with detctx.deterministic(seed=1234):\n    train(model, loader)\n"
    example = Example("headline", 1, code, frozenset({"fragment", "reproduces"}), None)

    first = _run([example], tmp_path / "first")[example.name]
    second = _run([example], tmp_path / "second")[example.name]

    assert first["error"] is None and "step 1 loss" in str(first["stdout"])
    assert first["stdout"] != second["stdout"]


def test_a_page_gives_its_python_fences_with_the_marker_before_each(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- example: fragment -->\n```python\nmodel.eval()\n```\n\n"
        "```bash\ndetctx demo\n```\n\n- an item:\n\n"
        "  <!-- example: continues, reproduces -->\n  ```python\n  train(model)\n  ```\n\n"
        "<!-- example: needs cuda -->\n```python\nrun_probe(['cuda'])\n```\n"
    )
    examples = read_examples(page)
    assert [(e.line, e.code, e.words, e.needs) for e in examples] == [
        (4, "model.eval()\n", {"fragment"}, None),
        (15, "model.eval()\ntrain(model)\n", {"fragment", "continues", "reproduces"}, None),
        (20, "run_probe(['cuda'])\n", set(), "cuda"),
    ]
    page.write_text("<!-- example: fragmnet -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="unknown example marker"):
        read_examples(page)


def test_every_file_the_docs_name_exists() -> None:
    named = {
        (page.name, path)
        for page in PAGES
        for path in re.findall(
            r"`((?:detctx|examples|tests|benchmarks|docs)/[\w/.-]+\.(?:py|md|json))`",
            page.read_text(encoding="utf-8"),
        )
    }
    assert named, "the docs name no source file at all: is the pattern still right?"
    assert {(page, path) for page, path in named if not (ROOT / path).exists()} == set()


def test_the_readmes_compatibility_agrees_with_pyproject_and_ci() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    compatibility = readme.split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")

    python = project["project"]["requires-python"].removeprefix(">=")
    assert f"Python >= {python}," in compatibility
    for requirement in project["project"]["dependencies"]:
        name, _, floor = requirement.partition(">=")
        if name in ("numpy", "torch"):
            assert f"{'NumPy' if name == 'numpy' else name} >= {floor}" in compatibility
    # every torch the table lists is one CI installs, and the reverse
    listed = set(re.findall(r"^\| (\d+\.\d+\.\d+)", compatibility, re.MULTILINE))
    installed = set(re.findall(r"torch==(\d+\.\d+\.\d+)", ci))
    installed |= set(re.findall(r"^core_suite (\d+\.\d+\.\d+)", ci, re.MULTILINE))
    assert listed == installed
    assert "python -m pytest -n auto" in ci and "python -m pytest -n auto" in readme
    markers = project["tool"]["pytest"]["ini_options"]["markers"]
    assert any(marker.startswith("slow:") for marker in markers)
    assert 'python -m pytest -m "not slow" -n 2' in readme
