"""The package's layout: imports flow one way, private names stay private, modules stay small."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_type_hints

import detctx
from detctx._environment import EnvSwitch, EnvSwitchOptions
from detctx._switches import SWITCHES, SwitchOptions

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "detctx"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """``(imported module, names taken from it)`` for every import in the file, lazy ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((base, [alias.name for alias in node.names]))
    return found


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for base, names in imports_of(path, name):
            submodules = {f"{base}.{item}" for item in names} & MODULES.keys()
            targets = submodules or ({base} & MODULES.keys())
            graph[name] |= targets - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt, [*path, nxt])
                if cycle:
                    return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = dependency_graph()
    assert graph.get("detctx._blocks.block")  # the walk sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


# The layers, bottom first, as docs/architecture.md draws them: a package imports only
# its own modules and packages of lower layers. The root package (the public face,
# importing lazily) may import from any layer.
LAYERS: list[set[str]] = [
    {"_version", "_basics"},
    {"_environment"},
    {"_sources"},
    {"_switches"},
    {"_state"},
    {"_blocks"},
    {"distributed"},
    {"_data", "_locate"},
    {"_proving", "_compare"},
    {"integrations"},
    {"pytest_plugin", "_cli"},
    {"__main__"},
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(name: str) -> str:
    """The top-level package or module under ``detctx`` that ``name`` belongs to."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_is_in_a_layer() -> None:
    assert {unit_of(name) for name in MODULES} - {""} == set(LAYER_OF)


def test_each_package_imports_only_the_layers_below_it() -> None:
    offenders = []
    for name, targets in dependency_graph().items():
        unit = unit_of(name)
        if not unit:
            continue  # the public face
        for target in targets:
            other = unit_of(target)
            if other and other != unit and LAYER_OF[other] >= LAYER_OF[unit]:
                offenders.append(f"{name} -> {target}")
    assert offenders == [], "an arrow up or sideways between layers"


def interface_of(package: str) -> set[str]:
    path = PACKAGE / package / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def test_another_package_is_imported_only_through_its_interface() -> None:
    # detctx.distributed and detctx.integrations.* are public; private packages expose
    # what other layers use in their __init__'s __all__.
    offenders = []
    for name, path in MODULES.items():
        unit = unit_of(name)
        for base, names in imports_of(path, name):
            if not base.startswith("detctx.") or unit_of(base) in ("", unit) or not unit:
                continue
            other = unit_of(base)
            if not (PACKAGE / other).is_dir():
                continue  # a top-level module (_version, pytest_plugin)
            inner = base.split(".")[2:]
            if base != f"detctx.{other}" and any(part.startswith("_") for part in inner):
                offenders.append(f"{name}: {base} is private to detctx.{other}")
            elif base == f"detctx.{other}":
                missing = set(names) - interface_of(other)
                if missing:
                    offenders.append(f"{name}: {sorted(missing)} not in detctx.{other}.__all__")
            elif other.startswith("_"):
                offenders.append(f"{name}: {base} is a module of the private detctx.{other}")
    assert offenders == []


def test_the_architecture_page_draws_the_same_layers() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page[page.index("## The layers") :]
    table = section[: section.index("\n## ", 1)]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`" in line]
    drawn = [set(re.findall(r"`(\w+)/?(?:\.py)?`", row.split("|")[2])) for row in rows]
    assert drawn == LAYERS


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_takes_a_private_name_from_another() -> None:
    # Private modules are the package's machinery and may be imported; the names
    # a module keeps private (a leading underscore) stay in that module.
    offenders = []
    for path in [*MODULES.values(), *sorted((ROOT / "tests").glob("*.py"))]:
        name = module_name(path)
        for base, names in imports_of(path, name):
            if base.split(".")[0] != "detctx" or base == name:
                continue
            private = [
                item
                for item in names
                if item.startswith("_")
                and not item.startswith("__")
                and f"{base}.{item}" not in MODULES
            ]
            if private:
                offenders.append(f"{name}: from {base} import {', '.join(private)}")
    assert offenders == []


def test_only_the_documented_modules_are_public() -> None:
    public = {
        name
        for name in MODULES
        if not any(part.startswith("_") for part in name.split("."))
    }
    assert public == {
        "detctx",
        "detctx.distributed",
        "detctx.integrations",
        "detctx.integrations.hypothesis",
        "detctx.integrations.lightning",
        "detctx.integrations.megatron",
        "detctx.integrations.transformers",
        "detctx.pytest_plugin",
    }, "a new module is private (a leading underscore) unless it is documented API"


def test_the_docs_import_only_public_modules() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offenders = [
        f"{page.name}: {line.strip()}"
        for page in pages
        for line in page.read_text(encoding="utf-8").splitlines()
        if re.search(r"(?<![\w/])detctx(\.\w+)*\._[a-z]", line)
    ]
    assert offenders == []


def test_every_module_is_a_few_hundred_lines_at_most() -> None:
    sizes = {
        name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()
    }
    assert {name: size for name, size in sizes.items() if size > MAX_LINES} == {}


def test_the_switch_options_are_declared_once_and_match_the_switches() -> None:
    assert list(get_type_hints(SwitchOptions)) == [
        *get_type_hints(EnvSwitchOptions),
        "algorithms",
        "cudnn",
        "npu_level",
    ]
    assert set(get_type_hints(SwitchOptions)) == {switch.name for switch in SWITCHES}
    env_names = {switch.name for switch in SWITCHES if isinstance(switch, EnvSwitch)}
    assert set(get_type_hints(EnvSwitchOptions)) == env_names


def test_an_unknown_switch_is_named_with_the_ones_that_exist() -> None:
    for make in (detctx.deterministic, detctx.seed_all, detctx.distributed_deterministic):
        try:
            make(seed=1, cudnn_benchmark=False)  # type: ignore[call-arg]
        except TypeError as exc:
            assert "cudnn_benchmark" in str(exc) and "algorithms" in str(exc)
        else:
            raise AssertionError(f"{make.__name__} accepted an unknown switch")


def test_the_public_names_all_resolve() -> None:
    for name in detctx.__all__:
        assert getattr(detctx, name) is not None


def test_the_architecture_page_names_every_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    unnamed = []
    for name, path in MODULES.items():
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py" and relative.parent != Path("."):
            continue  # a package is named by its folder's row
        if relative.parent == Path("."):
            shown = relative.name
        else:
            shown = relative.name if relative.name != "__init__.py" else str(relative.parent)
        if f"`{shown}`" not in page and f"`{relative}`" not in page and name != "detctx.__main__":
            unnamed.append(str(relative))
    assert unnamed == [], "docs/architecture.md's layer table should name these modules"


def test_no_call_to_a_detctx_function_passes_a_bare_true_or_false() -> None:
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}
    defined = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    offenders = [
        f"{name}:{node.lineno}: {ast.unparse(node)}"
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) in defined
        and any(isinstance(arg, ast.Constant) and type(arg.value) is bool for arg in node.args)
    ]
    assert offenders == [], "say what a flag means with a keyword"


def test_the_pages_for_users_name_no_private_module() -> None:
    # The pages that record how detctx is built (and was measured) name its files.
    internal = {"architecture.md", "benchmarks.md", "reliability.md"}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offenders = [
        f"{page.name}: {line.strip()}"
        for page in pages
        if page.name not in internal
        for line in page.read_text(encoding="utf-8").splitlines()
        if re.search(r"(?<![\w/])detctx/_[a-z]", line)
    ]
    assert offenders == []
