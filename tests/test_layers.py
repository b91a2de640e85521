"""The import contract (docs/design.md "Arrows point one way"), checked on the source: every `import` and
`from ... import` of a clover module, lazy ones inside functions included, must point down this stack.

    tools                  CLI entry points
    serve                  the HTTP layer: imports the runtime only (no model, export or training code)
    export | train         export-time and training-time work; they may run the runtime (ONNX Runtime
                           checks and timing at export, the tokenizer in training), never each other
    runtime                loads and runs artifacts; never imports export, train, serve or tools
    models                 torch modules
    plugins                tree attention (reference, kernel, ONNX node, TensorRT plugin)
    clover                 the bottom: errors, atomic writes, the artifact manifest, the TensorRT import

`clover/__init__.py` is exempt: it is the public facade (`clover.Engine`), imported lazily on attribute access.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "clover": "clover",
    "plugins": "plugins",
    "models": "models",
    "runtime": "runtime",
    "export": "export",
    "train": "train",
    "serve": "serve",
    "tools": "tools",
}
LEVEL = {"clover": 0, "plugins": 1, "models": 2, "runtime": 3, "export": 4, "train": 4, "serve": 5, "tools": 6}
ALLOWED_EXTRA = {"serve": {"clover", "runtime"}}  # narrower than its level allows


def package_of(module: str) -> str | None:
    """'clover.runtime.tree' -> 'runtime'; 'clover.errors' -> 'clover'; non-clover -> None."""
    parts = module.split(".")
    if parts[0] != "clover":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LEVEL and parts[1] != "clover" else "clover"


def clover_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("clover")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clover") and node.level == 0:
            if node.module == "clover":  # from clover import runtime / atomic
                found += [(node.lineno, f"clover.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return sorted(found)


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / PACKAGES[package]).rglob("*.py")):
        if package == "clover" and path.name == "__init__.py":
            continue
        for line, module in clover_imports(path):
            target = package_of(module)
            if target is None or target == package:
                continue
            allowed = LEVEL[target] < LEVEL[package] and target in ALLOWED_EXTRA.get(package, {target})
            if not allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({package} -> {target})")
    return bad


@pytest.mark.parametrize("package", list(LEVEL))
def test_imports_point_down_the_stack(package):
    assert violations(package) == []


def test_the_checker_sees_lazy_and_upward_imports(tmp_path):
    """The contract test can fail: an upward import inside a function is caught."""
    src = tmp_path / "m.py"
    src.write_text(
        "def f():\n    from clover.export.artifact import export_artifact\n    import clover.tools.cli\n"
        "from clover import atomic\n"
    )
    assert clover_imports(src) == [(2, "clover.export.artifact"), (3, "clover.tools.cli"), (4, "clover.atomic")]
    assert [package_of(m) for _, m in clover_imports(src)] == ["export", "tools", "clover"]


def runtime_graph(root: Path = ROOT / "runtime") -> dict[str, set[str]]:
    """Import edges among runtime/'s modules ('loop' -> {'policy', ...}; 'backends.ort' -> ...), lazy and
    type-only imports counted alike."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        graph[name] = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module in ("clover.runtime", "clover.runtime.backends"):
                    prefix = node.module.removeprefix("clover.runtime").lstrip(".")
                    names = [f"{prefix}.{a.name}".lstrip(".") for a in node.names]
                elif node.module.startswith("clover.runtime."):
                    names = [node.module.removeprefix("clover.runtime.")]
            elif isinstance(node, ast.Import):
                names = [
                    a.name.removeprefix("clover.runtime.") for a in node.names if a.name.startswith("clover.runtime.")
                ]
            graph[name] |= {n for n in names if n != name}
    return {m: {t for t in targets if t in graph or f"{t}.__init__" in graph} for m, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_among_runtime_modules():
    assert cycles(runtime_graph()) == []


def test_the_cycle_checker_sees_lazy_and_type_only_cycles(tmp_path):
    (tmp_path / "backends").mkdir()
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from clover.runtime.b import X\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from clover.runtime import a\n")
    (tmp_path / "c.py").write_text("from clover.runtime.backends import d\n")
    (tmp_path / "backends" / "d.py").write_text("import numpy\n")
    graph = runtime_graph(tmp_path)
    assert graph["a"] == {"b"} and graph["b"] == {"a"} and graph["c"] == {"backends.d"}
    assert cycles(graph) == [["a", "b"]]


# Size limits: a function longer than this is split into named parts (argparse parser builders excepted: a flat
# list of options reads best in one place); a public function or method of runtime/ or serve/ takes at most
# MAX_PARAMETERS (self excepted): more belong in a typed record.
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 7


def long_functions(paths) -> list[str]:
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("build_parser"):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    return bad


def wide_signatures(paths) -> list[str]:
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                count = len(params) - (bool(a.args) and a.args[0].arg in ("self", "cls"))
                if count > MAX_PARAMETERS:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {count} parameters")
    return bad


def package_files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / PACKAGES[pkg]).rglob("*.py"))]


def test_no_function_is_longer_than_the_limit():
    assert long_functions(package_files(*LEVEL)) == []


def test_no_public_signature_of_runtime_or_serve_is_wider_than_the_limit():
    assert wide_signatures(package_files("runtime", "serve")) == []
