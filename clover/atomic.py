"""Publishing a folder built beside its destination, so readers never see it half-written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def publish_folder(tmp: Path, dest: Path) -> None:
    """Make the finished folder `tmp` (a sibling of `dest`) become `dest`. An old `dest` is moved aside
    first and deleted last, so a crash never leaves neither the old folder nor the new one."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; what we publish is for everyone
    old = dest.parent / f".old-{dest.name}-{os.getpid()}" if dest.exists() else None
    if old is not None:
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
