"""Atomic writes: readers see the old file (or folder) or the new one, never a half-written one.

Every write that replaces a file in place goes through here. The temporary sibling gets a unique name
(mkstemp), so two writers of one path (two exports sharing a timing cache) never write into each
other's temporary file: the last rename wins with a whole file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def replacing(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of `path` for writing; on a clean exit it is flushed, synced and renamed
    onto `path`; on an exception it is deleted and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a published file is for everyone
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    with replacing(path, "wb") as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    with replacing(path, "w") as f:
        f.write(text)


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
