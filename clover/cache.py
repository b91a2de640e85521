"""Where clover-deploy keeps what it can rebuild: converted base models, exported demo artifacts, features,
verify-cost curves. No imports beyond the standard library."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of clover-deploy's cache: $CLOVER_CACHE, else $XDG_CACHE_HOME/clover-deploy, else ~/.cache/clover-deploy."""
    if os.environ.get("CLOVER_CACHE"):
        return Path(os.environ["CLOVER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clover-deploy"
