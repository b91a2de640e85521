"""The runtime core imports neither torch nor model code (docs/design.md: a CPU service runs it with numpy +
onnxruntime only); importing `clover` has no side effects."""

from helpers import run_python

CORE = [
    "clover",
    "clover.runtime.tree",
    "clover.runtime.sampling",
    "clover.runtime.acceptance",
    "clover.runtime.processors",
    "clover.runtime.logprobs",
    "clover.runtime.output",
    "clover.runtime.tokenizer",
    "clover.runtime.backend",
    "clover.runtime.loop",
    "clover.runtime.generator",
]


def test_runtime_core_imports_without_torch_or_models():
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'onnxruntime', 'tensorrt'):\n"
        "    sys.modules[name] = None  # any import of them now raises ImportError\n"
        f"for m in {CORE!r}:\n"
        "    __import__(m)\n"
        "bad = [m for m in sys.modules if m.startswith('clover.models')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    assert run_python(code).strip() == "ok"


def test_torch_backend_is_loaded_lazily_by_name():
    from clover.errors import CloverError
    from clover.runtime.backend import backend_module

    assert backend_module("torch").__name__ == "clover.runtime.backends.torch"
    try:
        backend_module("tensorrt-llm")
    except CloverError as e:
        assert "available backends are torch" in str(e)
    else:
        raise AssertionError("unknown backend accepted")


def test_the_ort_serving_path_imports_no_torch():
    """clover-serve on ONNX Runtime: the server, the engine, the graph runner and the ORT backend need no torch."""
    serving = [
        "clover.tools.serve",
        "clover.serve.app",
        "clover.runtime.engine",
        "clover.runtime.backends.ort",
        "clover.runtime.backends.graph",
    ]
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'tensorrt'):\n"
        "    sys.modules[name] = None\n"
        f"for m in {serving!r}:\n"
        "    __import__(m)\n"
        "bad = [m for m in sys.modules if m.startswith(('clover.models', 'clover.export', 'clover.train'))]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    assert run_python(code).strip() == "ok"
