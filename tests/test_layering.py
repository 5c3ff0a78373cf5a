"""The import rules, read from the source with `ast` (every import, at module level or inside a function;
not those under `if TYPE_CHECKING:`, which only annotations see):
`kernels` imports nothing of ours; `service` imports no `bench` and no `fusedserve` (the console script
dispatches to both); the two kinds of process keep apart (`service.engine` imports nothing of `service.frontend`
or `service.v2`, and they nothing of `service.engine`: what both need is in `service.link`, `service.backend`,
`service.model`); and no import cycle joins the modules of `service`, nor those of `bench`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("kernels", "service", "bench", "fusedserve")
FORBIDDEN = {"kernels": {"service", "bench", "fusedserve"}, "service": {"bench", "fusedserve"}}
# Packages of `service` that run in different processes, and the packages each must not import.
APART = {
    "service.engine": ("service.frontend", "service.v2"),
    "service.frontend": ("service.engine",),
    "service.v2": ("service.engine",),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(tree: ast.AST):
    """Every node, except those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_nodes(child)])
            continue
        yield node
        yield from _nodes(node)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            # `from . import x` / `from pkg import mod` may name submodules.
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_may(package):
    bad = []
    for path in _sources(package):
        for name in _imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(APART))
def test_engine_and_front_end_import_nothing_of_each_other(package):
    path = package.replace(".", "/")
    bad = [
        f"{source.relative_to(REPO)} imports {name}"
        for source in _sources(path)
        for name in _imports(source)
        if any(name == other or name.startswith(other + ".") for other in APART[package])
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["service", "bench"])
def test_no_import_cycle_among_a_packages_modules(package):
    modules = {_module_name(p): p for p in _sources(package)}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path, m, n]
            if n not in state and (cycle := visit(n, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_imports():
    """The rules above would pass vacuously if the parser found nothing."""
    imports = _imports(REPO / "bench" / "kernels" / "report.py")
    assert {"bench.kernels.results", "bench.kernels.targets", "json"} <= imports
    assert "service.cli" in _imports(REPO / "fusedserve" / "cli.py")
    assert "service.link.wire" in _imports(REPO / "service" / "engine" / "core.py")
    assert "service.frontend.serving" in _imports(REPO / "service" / "v2" / "rest.py")
    assert all((REPO / p).is_dir() for p in OURS)
