import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

# The suite measures verify-cost curves afresh (as tests that count forwards expect) and leaves the user's cache
# alone; tests of the cache turn it on with a folder of their own (tests/runtime/test_cost.py).
os.environ.setdefault("CLOVER_COST_CACHE", "0")

# Under pytest-xdist (`make test` runs -n auto) each worker takes its share of the cores: torch and ONNX Runtime
# sessions (runtime/backends/ort.env_threads) both read OMP_NUM_THREADS, so two workers that each ran a thread per
# core would oversubscribe the machine, and ONNX Runtime's spinning threads would steal each other's cores. Set here,
# before any test imports torch, and inherited by the servers and CLIs the tests start.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))


# Seconds each module took (setup, calls and teardown, its module fixtures included), measured by
# `make test-times`. `make test` runs xdist's loadscope with the scheduler below: each group (a module, or the modules
# of a SHARED_GROUPS entry) runs whole on one worker, so its module fixtures are built once, and groups start longest
# first, so the last to start are short ones and the workers finish together (longest-processing-time-first).
MODULE_TIMES = Path(__file__).with_name("module_times.json")
# Modules that share a group run on one worker, one after the other. Each Ray module starts a local cluster, and Ray
# Serve's HAProxy binds fixed ports, so a second cluster beside the first fails to start. The two SmolLM2 exports
# trace the same base graph (a minute): run in turn, the second copies the first's trace (export/trace_cache.py)
# instead of waiting for it.
SHARED_GROUPS = {
    "tests/serve/test_ray.py": "ray",
    "tests/serve/test_ray_cli.py": "ray",
    "tests/runtime/test_ort_smollm2.py": "smollm2-exports",
    "tests/runtime/test_ort_smollm2_quantized.py": "smollm2-exports",
}


def pytest_addoption(parser):
    parser.addoption("--record-module-times", metavar="PATH", help="write each module's seconds to PATH (JSON)")


def group_of(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return SHARED_GROUPS.get(module, module)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope by group_of instead of by module or class (xdist's loadgroup marks do not reach node ids
    under pytest 9.2)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Groups in descending measured time (a module not yet measured counts as the longest), each group's modules and
    tests in their collected order. Every worker collects the same order, as xdist requires."""
    times = json.loads(MODULE_TIMES.read_text())["seconds"] if MODULE_TIMES.is_file() else {}
    seconds: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        if module not in first:
            first[module] = i
            seconds[group_of(module)] += times.get(module, float("inf"))
        first.setdefault(group_of(module), i)
    items.sort(
        key=lambda it: (-seconds[group_of(it.nodeid)], first[group_of(it.nodeid)], first[it.nodeid.split("::")[0]])
    )


_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-module-times")
    if path and not hasattr(session.config, "workerinput"):  # the xdist controller (or a run without xdist)
        ranked = dict(sorted(((m, round(t, 1)) for m, t in _seconds.items()), key=lambda kv: -kv[1]))
        Path(path).write_text(
            json.dumps({"total_seconds": round(sum(_seconds.values()), 1), "seconds": ranked}, indent=1) + "\n"
        )


def pytest_unconfigure(config):
    """After pytest's own summary, the last lines of a run: the host's CPU and the longest modules' seconds, so that
    a run's tail (all a CI log may keep) says where its time went."""
    if hasattr(config, "workerinput") or len(_seconds) < 20:  # an xdist worker, or a run of a few modules
        return
    import platform

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), platform.processor()
    )
    flags = next((line.split(":", 1)[1].split() for line in _cpuinfo() if line.startswith("flags")), [])
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    ranked = sorted(_seconds.items(), key=lambda kv: -kv[1])
    print(
        f"\nmodule seconds ({cpu}, {isa}{' + AMX' if 'amx_tile' in flags else ''}, {os.cpu_count()} cores; "
        f"all modules {sum(_seconds.values()):.0f} s):"
    )
    print(", ".join(f"{m.removeprefix('tests/')} {t:.0f}" for m, t in ranked[:16]))


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


@pytest.fixture(scope="session", autouse=True)
def _trace_cache(tmp_path_factory):
    """One trace cache per run (export/trace_cache.py), shared by the run's workers and the CLIs they start: the
    tiny modules' graphs are traced once for all the variants the tests export, and nothing is read from or left in
    the user's cache. CLOVER_TRACE_CACHE=0 make test traces every export afresh."""
    from helpers import shared_root

    os.environ.setdefault("CLOVER_TRACE_CACHE", str(shared_root(tmp_path_factory.getbasetemp()) / "traces"))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A CLI run in-process with --threads sets torch's process-wide count: the next test gets the worker's own."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted embedded default (converted once into the cache; skipped if the package is absent)."""
    from clover.errors import CloverError
    from clover.models.smollm2 import smollm2_dir

    try:
        return smollm2_dir()
    except CloverError as e:
        pytest.skip(str(e))
