"""The shape of the library: h3lab's import graph has no cycle, and no package imports one above it.

The graph is read from the source (every `import` statement, also inside functions and under
TYPE_CHECKING), so an import that only runs on a GPU counts as much as one that runs here. The
layers are ARCHITECTURE.md's; a package may import its own modules and those of the packages it
lists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "h3lab"

CORE = "core"  # the flat modules of h3lab/, the block, the torch references (ops), the kernels (triton), emulate
MAY_IMPORT: dict[str, set[str]] = {
    CORE: set(),
    "io": {CORE},
    "model": {CORE, "io"},
    "reference": {CORE, "io", "model"},
    "parallel": {CORE},
    "launch": {CORE},
    "train": {CORE, "io", "model"},
    "nn": {CORE, "io", "model", "parallel", "train"},
    "optim": {CORE, "io", "model", "parallel", "train", "nn"},
    "run": {CORE, "io", "model", "reference", "parallel", "launch", "train", "nn", "optim"},
    "bench": {CORE, "io", "model", "reference", "parallel", "launch", "train", "nn", "optim", "run"},
    "workbench": {CORE, "io", "model", "reference", "parallel", "launch", "train", "nn", "optim", "run"},
    "cli": {
        CORE,
        "io",
        "model",
        "reference",
        "parallel",
        "launch",
        "train",
        "nn",
        "optim",
        "run",
        "bench",
        "workbench",
    },
    "facade": {CORE, "io", "nn", "optim"},  # h3lab/__init__.py: the public surface (nn, optim on first use)
}
PACKAGES = {
    "block": CORE,
    "ops": CORE,
    "triton": CORE,
    "emulate": CORE,
    "io": "io",
    "model": "model",
    "reference": "reference",
    "parallel": "parallel",
    "launch": "launch",
    "train": "train",
    "nn": "nn",
    "optim": "optim",
    "run": "run",
    "bench": "bench",
    "workbench": "workbench",
    "cli": "cli",
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """The h3lab modules `path` imports (a `from pkg import name` counts pkg.name where that is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "h3lab" or m.startswith("h3lab.")}


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p, m) if i in paths and i != m} for m, p in paths.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == "h3lab":
        return "facade"
    if module == "h3lab.__main__":
        return "cli"
    return PACKAGES.get(parts[1], CORE) if len(parts) > 2 or parts[1] in PACKAGES else CORE


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _parent_packages(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_import_graph_has_no_cycle():
    # a module importing its own package's __init__ (h3lab.triton.gemm -> h3lab.triton) is how Python
    # loads it anyway, not a cycle of ours: those edges are left out
    graph = {m: {i for i in deps if i not in _parent_packages(m)} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_no_package_imports_one_above_it():
    bad = []
    for module, deps in sorted(_graph().items()):
        layer = _layer(module)
        for dep in sorted(deps):
            other = _layer(dep)
            if other != layer and other not in MAY_IMPORT[layer] and dep not in _parent_packages(module):
                bad.append(f"{module} ({layer}) imports {dep} ({other})")
    assert bad == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}, [["a", "b", "c"]]), ({"a": {"b"}, "b": set()}, [])],
)
def test_the_cycle_finder_sees_a_planted_cycle(graph, expected):
    assert _cycles(graph) == expected


def test_the_layer_check_sees_a_planted_upward_import():
    assert _layer("h3lab.block") == CORE and _layer("h3lab.run.runner") == "run"
    assert "run" not in MAY_IMPORT[CORE] and "cli" not in MAY_IMPORT["workbench"]


SCREEN_LINES, FILE_LINES = 60, 400  # a function that fits on a screen; a file one reads in one sitting


def _long_without_reason(source: str) -> list[str]:
    """The functions over SCREEN_LINES and the file over FILE_LINES without an "on purpose" reason: a
    function's in the three lines above its decorators or def, or its first three; a file's in its
    first three."""
    lines = source.splitlines()
    near = lambda a, b: any("on purpose" in line for line in lines[max(a, 0) : b])  # noqa: E731
    bad = [f"{len(lines)} lines"] if len(lines) > FILE_LINES and not near(0, 3) else []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > SCREEN_LINES:
            top = min([n.lineno, *(d.lineno for d in n.decorator_list)])
            if not near(top - 4, n.lineno + 3):
                bad.append(f"{n.name}: {n.end_lineno - n.lineno + 1} lines")
    return bad


def test_no_long_file_or_function_without_a_reason_at_its_top():
    bad = {
        str(p.relative_to(ROOT)): b for p in sorted(ROOT.rglob("*.py")) if (b := _long_without_reason(p.read_text()))
    }
    assert bad == {}, "split them, or say why they stay whole (# One function on purpose: ...)"


def test_the_length_check_sees_a_long_function_and_its_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(SCREEN_LINES))
    assert _long_without_reason(f"def f():\n{body}") == [f"f: {SCREEN_LINES + 1} lines"]
    assert _long_without_reason(f"# One function on purpose: a kernel\n@jit\ndef f():\n{body}") == []
