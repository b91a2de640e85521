import os

import pytest

# The suite measures verify-cost curves afresh (as tests that count forwards expect) and leaves the user's cache
# alone; tests of the cache turn it on with a folder of their own (tests/runtime/test_cost.py).
os.environ.setdefault("CLOVER_COST_CACHE", "0")


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted embedded default (converted once into the cache; skipped if the package is absent)."""
    from clover.errors import CloverError
    from clover.models.smollm2 import smollm2_dir

    try:
        return smollm2_dir()
    except CloverError as e:
        pytest.skip(str(e))
