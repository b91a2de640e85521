"""Atomic writes: readers see the old file (or folder) or the new one, never a half-written one.

Every write that replaces a file in place goes through here. The temporary sibling gets a unique name
(mkstemp), so two writers of one path (two exports sharing a timing cache) never write into each
other's temporary file: the last rename wins with a whole file. Files are synced before their rename and the
folder holding the rename after it, so a power cut leaves the old version or the new one on disk, not an empty file
under the final name. A write that finds no room (a full device, a quota, a file size limit) raises one CloverError line
naming what was being written.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from clover.errors import CloverError


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
        fsync_dir(path.parent)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        no_room = space_error(e, path, path.parent)
        if no_room is not None:
            raise no_room from e
        raise


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new entry in `folder` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder: nothing more can be done there
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Sync every file and folder under `folder` (before it is renamed into place)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def write_bytes(path: str | Path, data: bytes) -> None:
    with replacing(path, "wb") as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    with replacing(path, "w") as f:
        f.write(text)


@contextmanager
def staging_folder(dest: str | Path) -> Iterator[Path]:
    """A hidden folder beside `dest` (`.tmp-<name>-<pid>-*`) to build `dest` in, removed unless the caller
    published it. Removed too when the process is stopped by SIGINT or SIGTERM (SIGTERM becomes
    SystemExit(143) while the folder exists, main thread only). A SIGKILL cannot be caught, so entering
    also sweeps the staging folders of `dest` left by processes that no longer exist, and the `.old-`
    folder publish_folder moves aside if one was killed between its two renames."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-{os.getpid()}-", dir=dest.parent))
    previous = {}
    if threading.current_thread() is threading.main_thread():

        def stop(signum: int, frame: object) -> None:
            # remembered too: a library may catch the exception raised here, and a stopped build must
            # still never be published (publish_folder raises it again)
            _stopped[tmp] = signum
            _raise_for(signum)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield tmp
    except BaseException as e:
        no_room = space_error(e, dest, tmp)  # before the staging folder's files are deleted (and their room freed)
        if no_room is not None:
            raise no_room from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left once published
        _stopped.pop(tmp, None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_stopped: dict[Path, int] = {}  # staging folder -> the signal that stopped its build


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def sweep_stale(dest: Path) -> list[Path]:
    """Delete `dest`'s staging and set-aside folders whose writing process is gone; returns them. A set-aside folder
    with no `dest` beside it is the old `dest` of a process killed between publish_folder's two renames: unless empty,
    it is moved back to `dest`, not deleted."""
    pattern = re.compile(rf"^\.(tmp|old)-{re.escape(dest.name)}-(\d+)(?:-.*)?$")
    swept = []
    for entry in dest.parent.iterdir() if dest.parent.is_dir() else ():
        m = pattern.match(entry.name)
        if m and entry.is_dir() and not process_alive(int(m[2])):
            if m[1] == "old" and not dest.exists() and any(entry.iterdir()):
                os.replace(entry, dest)
                fsync_dir(dest.parent)
            else:
                shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry)
    return swept


# errno -> what it means for a write, and what to do
NO_ROOM = {
    errno.ENOSPC: ("no space left on device", "free space there or choose another folder"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or choose another folder"),
    errno.EFBIG: (
        "file too large (the file system's or this process's file size limit, ulimit -f)",
        "raise the limit or choose another folder",
    ),
}
LOW_SPACE = 1 << 20  # bytes


def space_error(error: BaseException, path: Path, folder: Path) -> CloverError | None:
    """One CloverError line naming `path` when `error`, or an exception it was raised from, is a write that found no
    room: an OSError with an errno of NO_ROOM, or one without an errno (numpy's tofile, which torch.onnx writes weights
    with, drops it) while the device of `folder` (where the writing went) has under LOW_SPACE bytes free. None
    otherwise (always for a Ctrl-C or a SIGTERM, whatever they interrupted)."""
    seen: set[int] = set()
    while isinstance(error, Exception) and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            code = error.errno
            if code is None and free_bytes(folder) < LOW_SPACE:
                code = errno.ENOSPC
            if code in NO_ROOM:
                what, fix = NO_ROOM[code]
                return CloverError(f"{what} writing {path}: {fix}")
        error = error.__cause__ or error.__context__
    return None


def free_bytes(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return LOW_SPACE
    return st.f_bavail * st.f_frsize


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def publish_folder(tmp: Path, dest: Path) -> None:
    """Make the finished folder `tmp` (a sibling of `dest`) become `dest`. An old `dest` is swapped with `tmp` in one
    atomic exchange where the system can (Linux), else moved aside first and deleted last: a crash never leaves
    neither the old folder nor the new one. A build stopped by
    SIGINT / SIGTERM (staging_folder) is not published, even if something caught the exception it raised."""
    if tmp in _stopped:
        _raise_for(_stopped[tmp])
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; what we publish is for everyone
    fsync_tree(tmp)  # its contents on disk before the rename makes them the real thing
    if dest.exists() and exchange(tmp, dest):  # one atomic step: `dest` is never missing, even for a moment
        fsync_dir(dest.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # the old folder, now under the staging name
        return
    old = dest.parent / f".old-{dest.name}-{os.getpid()}" if dest.exists() else None
    if old is not None:  # no exchange here: a crash between the renames leaves `old`, which sweep_stale moves back
        os.replace(dest, old)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE, glibc >= 2.28); False where the system or the file
    system cannot, and the caller renames in two steps instead."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100  # AT_FDCWD
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
