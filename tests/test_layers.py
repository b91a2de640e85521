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
