import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted embedded default (converted once into the cache; skipped if the package is absent)."""
    from clover.errors import CloverError
    from clover.models.smollm2 import smollm2_dir

    try:
        return smollm2_dir()
    except CloverError as e:
        pytest.skip(str(e))
