"""The pytest plugin: marker, detctx_seeding fixture and --detctx-seed, run with pytester."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from helpers import draws, mindspeed_seed

import detctx
from detctx.pytest_plugin import node_seed

pytest_plugins = ["pytester"]

# Imported by the integrations alone; no in-process run here loads them.
OPTIONAL_FRAMEWORKS = ("detctx.integrations.lightning", "detctx.integrations.transformers")


def library_modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(detctx.__path__, "detctx.")
        if not info.name.endswith("__main__") and info.name not in OPTIONAL_FRAMEWORKS
    ]


def orphans() -> list[str]:
    """detctx modules the package holds as attributes that are not the ones in sys.modules."""
    found = []
    for name in library_modules():
        parent, _, child = name.rpartition(".")
        held = getattr(sys.modules.get(parent), child, None)
        if held is not None and sys.modules.get(name) is not held:
            found.append(name)
    return found


@pytest.fixture(autouse=True, scope="module")
def _library_imported_before_in_process_runs() -> None:
    """pytester's in-process runs drop from sys.modules every module first imported during
    them (pytest's SysModulesSnapshot), while the package keeps them as attributes, so a later
    import makes a second copy of, say, detctx._basics.errors, and tests run after this file compare
    objects from two copies. Import the library first: then nothing of it is new in a run."""
    for name in library_modules():
        importlib.import_module(name)


# The inner projects get a copy of the shared helpers under a name of their own: pytester
# runs them in this process, where ``helpers`` is already this directory's module.
INNER_HELPERS = f"""
from __future__ import annotations

import random

import numpy as np
import torch


{inspect.getsource(draws)}

{inspect.getsource(mindspeed_seed)}

# Keep the test's seed in seeds/ (a file each: pytest-xdist workers run at the same time).
def record(request, seeding):
    folder = request.config.rootpath / "seeds"
    folder.mkdir(exist_ok=True)
    (folder / request.node.name).write_text(f"{{request.node.nodeid}} {{seeding.seed}}")


def seeded(seed):
    mindspeed_seed(seed)
    return draws()
"""


def seeds_recorded(pytester: pytest.Pytester) -> dict[str, int]:
    """The seeds the inner tests kept in seeds/, emptying it for the next run."""
    found = {}
    for path in sorted((pytester.path / "seeds").iterdir()):
        nodeid, seed = path.read_text().split()
        found[nodeid] = int(seed)
        path.unlink()
    return found


@pytest.fixture
def helpers(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(inner_helpers=INNER_HELPERS)
    return pytester


def test_the_marker_runs_the_test_and_its_fixtures_in_a_seeded_block(
    helpers: pytest.Pytester,
) -> None:
    helpers.makepyfile(
        test_marker="""
        import pytest
        import torch
        from inner_helpers import draws, seeded

        @pytest.fixture
        def weights():
            return draws()

        @pytest.mark.deterministic(seed=3)
        def test_fixture_and_body_are_seeded(weights):
            body = draws()
            assert torch.are_deterministic_algorithms_enabled()
            first = seeded(3)
            assert (weights, body) == (first, draws())

        @pytest.mark.deterministic(4, algorithms=False)
        def test_positional_seed_and_switch_options():
            assert draws() == seeded(4)
            assert not torch.are_deterministic_algorithms_enabled()

        @pytest.mark.deterministic(seed=6)
        class TestGrouped:
            def test_class_marker(self):
                assert draws() == seeded(6)

        def test_unmarked_tests_are_left_alone():
            assert not torch.are_deterministic_algorithms_enabled()
        """
    )
    helpers.runpytest("-W", "error::pytest.PytestUnknownMarkWarning").assert_outcomes(passed=4)


def test_a_marked_test_keeps_its_seeded_streams_under_pytest_randomly(
    helpers: pytest.Pytester,
) -> None:
    # pytest-randomly seeds random and NumPy again right before every test body; the
    # body of a marked test still goes on with the streams its seeded fixtures left.
    pytest.importorskip("pytest_randomly")
    helpers.makepyfile(
        test_randomly="""
        import random

        import numpy as np
        import pytest
        import detctx

        @pytest.fixture
        def first():
            return random.random(), float(np.random.rand())

        @pytest.mark.deterministic(seed=11)
        def test_fixture_and_body_share_one_seeded_stream(first):
            body = random.random(), float(np.random.rand())
            with detctx.deterministic(seed=11):
                expected = [(random.random(), float(np.random.rand())) for _ in range(2)]
            assert [first, body] == expected
        """
    )
    for seed in ("1", "2"):
        helpers.runpytest("-p", "randomly", f"--randomly-seed={seed}").assert_outcomes(passed=1)


def test_an_in_process_run_leaves_one_copy_of_every_library_module(
    helpers: pytest.Pytester,
) -> None:
    helpers.makepyfile(
        test_marked="""
        import pytest
        from inner_helpers import draws

        @pytest.mark.deterministic(seed=3)
        def test_draws():
            draws()
        """
    )
    helpers.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)

    assert orphans() == []


def test_the_detctx_seeding_fixture_reports_the_active_block(helpers: pytest.Pytester) -> None:
    helpers.makepyfile(
        test_fixture="""
        import pytest
        import torch
        from inner_helpers import draws, seeded

        @pytest.mark.deterministic(seed=9)
        def test_inside_the_markers_block(detctx_seeding):
            assert detctx_seeding.seed == 9
            assert draws() == seeded(9)

        def test_a_block_of_its_own_without_a_marker(detctx_seeding):
            assert detctx_seeding.seed == 1234
            assert torch.are_deterministic_algorithms_enabled()
            assert draws() == seeded(1234)
        """
    )
    helpers.runpytest().assert_outcomes(passed=2)


def test_the_former_fixture_name_works_and_warns_at_the_test_that_asks_for_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_old="""
        import pytest

        @pytest.mark.deterministic(seed=4)
        def test_old_name(detctx_run, detctx_seeding):
            assert detctx_run is detctx_seeding and detctx_run.seed == 4
        """
    )

    result = pytester.runpytest("-W", "always::DeprecationWarning")

    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_old.py:[34]: DeprecationWarning: the detctx_run fixture is deprecated"
            "*detctx_seeding"
        ]
    )


def test_bad_marker_arguments_fail_that_test_with_a_clear_message(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.deterministic(seed="zero")
        def test_bad_seed():
            pass

        @pytest.mark.deterministic(seed=1, algorithm=True)
        def test_misspelt_switch():
            pass

        def test_others_still_run():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=2)
    # Each on its own: the tests may run in any order (pytest-randomly).
    result.stdout.fnmatch_lines(
        [
            "*bad @pytest.mark.deterministic(...) arguments on test_bad.py::test_bad_seed: "
            "seed must be an integer*"
        ]
    )
    result.stdout.fnmatch_lines(["*test_misspelt_switch*unexpected keyword argument 'algorithm'*"])
    # one message each, not the ValueError first under "During handling of ..."
    assert "During handling of the above exception" not in result.stdout.str()


SEEDED_SESSION = """
import pytest
from inner_helpers import draws, record, seeded

def test_a(detctx_seeding, request):
    record(request, detctx_seeding)
    assert draws() == seeded(detctx_seeding.seed)

def test_b(detctx_seeding, request):
    record(request, detctx_seeding)

@pytest.mark.deterministic(seed=2)
def test_pinned(detctx_seeding, request):
    record(request, detctx_seeding)

@pytest.mark.deterministic(algorithms="warn")
def test_marker_without_seed(detctx_seeding, request):
    record(request, detctx_seeding)
"""


@pytest.mark.slow
def test_detctx_seed_seeds_each_test_from_the_option_and_its_node_id(
    helpers: pytest.Pytester,
) -> None:
    helpers.makepyfile(test_session=SEEDED_SESSION)
    result = helpers.runpytest("--detctx-seed", "5")
    result.assert_outcomes(passed=4)
    seeds = seeds_recorded(helpers)
    assert seeds == {
        "test_session.py::test_a": node_seed(5, "test_session.py::test_a"),
        "test_session.py::test_b": node_seed(5, "test_session.py::test_b"),
        "test_session.py::test_pinned": 2,
        "test_session.py::test_marker_without_seed": node_seed(
            5, "test_session.py::test_marker_without_seed"
        ),
    }
    assert seeds["test_session.py::test_a"] != seeds["test_session.py::test_b"]
    result.stdout.fnmatch_lines(["detctx: --detctx-seed 5 (each test seeded from it*"])

    # Another order, and a single test on its own: the same seeds.
    helpers.runpytest(
        "--detctx-seed", "5", "test_session.py::test_b", "test_session.py::test_a"
    ).assert_outcomes(passed=2)
    assert seeds_recorded(helpers) == {
        key: seeds[key] for key in ("test_session.py::test_a", "test_session.py::test_b")
    }
    helpers.runpytest("--detctx-seed", "5", "test_session.py::test_b").assert_outcomes(passed=1)
    assert seeds_recorded(helpers) == {"test_session.py::test_b": seeds["test_session.py::test_b"]}
    # Another session seed, other test seeds.
    helpers.runpytest("--detctx-seed", "6", "test_session.py::test_a").assert_outcomes(passed=1)
    assert seeds_recorded(helpers)["test_session.py::test_a"] != seeds["test_session.py::test_a"]


def test_the_seed_is_in_the_summary_even_under_quiet(helpers: pytest.Pytester) -> None:
    helpers.makepyfile(test_session=SEEDED_SESSION)
    result = helpers.runpytest("-q", "--detctx-seed", "5")
    result.assert_outcomes(passed=4)
    assert "detctx: --detctx-seed 5 (each" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        ["detctx: every test was seeded from --detctx-seed 5 and its node id; replay with: *"]
    )


@pytest.mark.slow
def test_a_failure_under_detctx_seed_replays_exactly(helpers: pytest.Pytester) -> None:
    helpers.makepyfile(
        test_flaky="""
        import torch

        def test_loss_below_threshold():
            loss = float(torch.rand(1))
            assert loss < 0.0, f"loss was {loss!r}"
        """
    )
    first = helpers.runpytest("-q", "--detctx-seed", "5")
    second = helpers.runpytest("-q", "--detctx-seed", "5", "test_flaky.py")
    first.assert_outcomes(failed=1)
    second.assert_outcomes(failed=1)
    failures = [re.findall(r"loss was [0-9.e-]+", r.stdout.str()) for r in (first, second)]
    seed = node_seed(5, "test_flaky.py::test_loss_below_threshold")
    import torch

    torch.manual_seed(seed)
    expected = f"loss was {float(torch.rand(1))!r}"
    assert failures[0] == failures[1] and failures[0][0] == expected
    first.stdout.fnmatch_lines(
        [
            "*detctx*",
            f"this test ran under detctx.deterministic(seed={seed})",
            f"detctx: test_flaky.py::test_loss_below_threshold failed with seed {seed}",
        ]
    )


@pytest.mark.parametrize("value", ["five", "-1", str(2**32), "٣", "1_000"])
def test_a_bad_detctx_seed_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(test_nothing="def test_nothing(): pass")
    result = pytester.runpytest("--detctx-seed", value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--detctx-seed*"])


@pytest.mark.slow
def test_hypothesis_tests_run_under_the_marker_and_the_option(helpers: pytest.Pytester) -> None:
    helpers.makepyfile(
        test_props="""
        import random

        import pytest
        from hypothesis import given, settings, strategies as st

        import torch

        @pytest.mark.deterministic(seed=1)
        @settings(max_examples=20, database=None)
        @given(st.integers(0, 100))
        def test_under_the_marker(n):
            assert torch.are_deterministic_algorithms_enabled()
            assert 0 <= random.random() < 1

        @settings(max_examples=20, database=None)
        @given(st.lists(st.floats(allow_nan=False), max_size=5))
        def test_under_the_option(xs):
            assert sorted(xs) == sorted(reversed(xs))
            assert torch.are_deterministic_algorithms_enabled()
        """
    )
    helpers.runpytest("--detctx-seed", "5").assert_outcomes(passed=2)
    helpers.runpytest("test_props.py::test_under_the_marker").assert_outcomes(passed=1)


@pytest.mark.slow
def test_pytest_xdist_workers_derive_the_same_seeds(helpers: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    helpers.makepyfile(test_session=SEEDED_SESSION)
    helpers.runpytest("--detctx-seed", "5").assert_outcomes(passed=4)
    serial = seeds_recorded(helpers)
    parallel = helpers.runpytest_subprocess("-n", "2", "--detctx-seed", "5")
    parallel.assert_outcomes(passed=4)
    assert seeds_recorded(helpers) == serial
    parallel.stdout.fnmatch_lines(["detctx: every test was seeded from --detctx-seed 5*"])


def test_installing_detctx_is_enough_to_load_the_plugin(pytester: pytest.Pytester) -> None:
    names = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert names.get("detctx") == "detctx.pytest_plugin"
    pytester.makepyfile(test_nothing="def test_nothing(): pass")
    result = pytester.runpytest("--detctx-seed", "1")
    result.stdout.fnmatch_lines(["detctx: --detctx-seed 1 *", "plugins:*detctx-*"])


# --- start-up: the plugin loads nothing heavy until a test needs it ------------------------------

# What detctx's own modules import: another plugin may import NumPy at start-up
# (pytest-benchmark, jaxtyping), and that is not detctx's doing.
LOADED = """
import builtins, json, sys
import pytest

heavy = set()
real_import = builtins.__import__

def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    top = name.split(".")[0]
    if level == 0 and top in ("torch", "numpy") and importer.split(".")[0] == "detctx":
        heavy.add(top)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = recording_import
code = pytest.main(sys.argv[1:])
library = sorted(name for name in sys.modules if name.startswith("detctx."))
print(json.dumps({"code": int(code), "heavy": sorted(heavy), "library": library}))
"""


def pytest_in_a_fresh_process(folder: Path, *args: str) -> dict[str, Any]:
    """Run pytest with ``args`` in ``folder``, in a fresh interpreter with plugins
    autoloaded; what it imported: the heavy modules detctx imported, and detctx's modules."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-c", LOADED, "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
        env=env,
    )
    assert done.stdout.strip(), done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_pytest_help_lists_the_option_without_importing_torch_or_numpy(tmp_path: Path) -> None:
    loaded = pytest_in_a_fresh_process(tmp_path, "--help")
    assert loaded["code"] == 0
    assert "detctx.pytest_plugin" in loaded["library"]
    assert loaded["heavy"] == []


@pytest.mark.slow
def test_a_project_without_torch_runs_its_tests_without_importing_torch(tmp_path: Path) -> None:
    (tmp_path / "test_plain.py").write_text("def test_sum():\n    assert sum([1, 2]) == 3\n")
    loaded = pytest_in_a_fresh_process(tmp_path, "-q")
    assert loaded["code"] == 0
    assert "detctx.pytest_plugin" in loaded["library"]
    assert loaded["heavy"] == []


@pytest.mark.slow
def test_numpy_imported_at_start_up_by_another_plugin_is_not_counted_as_detctxs(
    tmp_path: Path,
) -> None:
    (tmp_path / "conftest.py").write_text("import numpy  # as pytest-benchmark's plugin does\n")
    (tmp_path / "test_plain.py").write_text("def test_sum():\n    assert sum([1, 2]) == 3\n")
    loaded = pytest_in_a_fresh_process(tmp_path, "-q")
    assert loaded["code"] == 0
    assert loaded["heavy"] == []


@pytest.mark.slow
def test_the_first_test_that_uses_the_marker_loads_the_library(tmp_path: Path) -> None:
    (tmp_path / "test_marked.py").write_text(
        "import random, pytest\n\n"
        "def test_plain():\n    pass\n\n"
        "@pytest.mark.deterministic(seed=3)\n"
        "def test_marked():\n    assert random.random() == random.Random(3).random()\n"
    )
    loaded = pytest_in_a_fresh_process(tmp_path, "-q")
    assert loaded["code"] == 0
    assert loaded["heavy"] == ["numpy", "torch"]
    assert "detctx._blocks.block" in loaded["library"]
