"""`import detctx` loads nothing else; each public name is imported on first use."""

from __future__ import annotations

import ast
import importlib
import json

import pytest
from conftest import ROOT, run_python

import detctx


def type_checking_imports() -> dict[str, str]:
    """``{public name: home module}`` from ``detctx/__init__.py``'s ``if TYPE_CHECKING:``."""
    tree = ast.parse((ROOT / "detctx" / "__init__.py").read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    for alias in statement.names:
                        found[alias.asname or alias.name] = statement.module
    return found


def test_import_detctx_imports_neither_torch_nor_numpy() -> None:
    out = run_python(
        """
        import json, sys
        import detctx
        heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "numpy"})
        print(json.dumps({"heavy": heavy, "version": detctx.__version__}))
        """
    )
    assert json.loads(out.strip().splitlines()[-1]) == {"heavy": [], "version": "0.1.0"}


@pytest.mark.slow
def test_from_detctx_import_works_in_a_fresh_process() -> None:
    out = run_python(
        """
        import random
        from detctx import Seeding, deterministic

        with deterministic(seed=3) as seeding:
            drawn = random.random()
        print(isinstance(seeding, Seeding), drawn == random.Random(3).random())
        """
    )
    assert out.split() == ["True", "True"]


def test_every_public_name_is_the_object_its_module_defines() -> None:
    homes = type_checking_imports()
    assert set(detctx.__all__) == {*homes, "__version__"}
    for name, module in homes.items():
        assert getattr(detctx, name) is getattr(importlib.import_module(module), name), name
    assert set(detctx.__all__) <= set(dir(detctx))


def test_submodules_are_reachable_as_attributes_and_a_misspelt_name_is_an_error() -> None:
    assert detctx.distributed is importlib.import_module("detctx.distributed")
    with pytest.raises(AttributeError, match="has no attribute 'deterministc'"):
        detctx.deterministc  # type: ignore[attr-defined]  # noqa: B018
