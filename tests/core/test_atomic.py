"""clover.atomic: whole files or nothing, unique temporary names, staging folders that clean up after themselves."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clover import atomic


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "cache.bin"
    atomic.write_bytes(path, b"one")
    atomic.write_text(path, "two")
    assert path.read_text() == "two" and os.listdir(path.parent) == ["cache.bin"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # published for everyone (umask permitting)


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "doc.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic.replacing(path, "w") as f:
            f.write("half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["doc.json"]


def test_two_writers_of_one_path_use_their_own_temporary_files(tmp_path):
    path = tmp_path / "timing.cache"
    with atomic.replacing(path) as a, atomic.replacing(path) as b:
        assert len([n for n in os.listdir(tmp_path) if n.startswith(".timing.cache.")]) == 2
        a.write(b"a" * 1000)
        b.write(b"b" * 10)
    assert path.read_bytes() == b"a" * 1000  # b closes first; the last rename (a) wins, with a whole file


def test_staging_folder_is_removed_unless_published(tmp_path):
    dest = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        with atomic.staging_folder(dest) as tmp:
            (tmp / "base.onnx").write_bytes(b"partial")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    with atomic.staging_folder(dest) as tmp:
        (tmp / "manifest.json").write_text("{}")
        atomic.publish_folder(tmp, dest)
    assert os.listdir(tmp_path) == ["art"] and (dest / "manifest.json").is_file()


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_stopped_build_is_not_published_even_if_the_signal_was_swallowed(tmp_path, sig, raised):
    """Ctrl-C / SIGTERM caught by a library mid-build (the export then runs to its end): publishing raises it."""
    dest = tmp_path / "art"
    with pytest.raises(raised):
        with atomic.staging_folder(dest) as tmp:
            try:
                os.kill(os.getpid(), sig)
                time.sleep(1)  # the handler runs here
            except BaseException:  # noqa: BLE001 (what a careless library does)
                pass
            (tmp / "manifest.json").write_text("{}")
            atomic.publish_folder(tmp, dest)
    assert os.listdir(tmp_path) == []
    with atomic.staging_folder(dest) as tmp:  # the next build publishes as usual
        atomic.publish_folder(tmp, dest)
    assert os.listdir(tmp_path) == ["art"]


def test_stale_staging_of_dead_processes_is_swept_live_ones_kept(tmp_path):
    dest = tmp_path / "art"
    dead, live = dead_pid(), os.getpid()
    for name in (f".tmp-art-{dead}-x1", f".old-art-{dead}", f".tmp-art-{live}-x2", f".tmp-other-{dead}-x3"):
        (tmp_path / name).mkdir()
    with atomic.staging_folder(dest) as tmp:
        left = sorted(p.name for p in tmp_path.iterdir() if p != tmp)
    assert left == [f".tmp-art-{live}-x2", f".tmp-other-{dead}-x3"]


def test_renames_are_made_durable_files_synced_then_their_folder(tmp_path, monkeypatch):
    """A file's rename is followed by an fsync of its folder; a published folder's files and folders are synced
    before the rename, and the parent after it (else a power cut can leave an empty file under the final name)."""
    from clover import atomic

    synced_dirs, real_fsync, synced_fds = [], os.fsync, []
    monkeypatch.setattr(atomic, "fsync_dir", lambda folder: synced_dirs.append(Path(folder)))
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced_fds.append(fd), real_fsync(fd)))
    atomic.write_text(tmp_path / "a.json", "{}")
    assert synced_dirs == [tmp_path] and len(synced_fds) == 1
    synced_dirs.clear()
    with atomic.staging_folder(tmp_path / "art") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "g.onnx").write_bytes(b"x")
        (tmp / "manifest.json").write_text("{}")
        synced_fds.clear()
        atomic.publish_folder(tmp, tmp_path / "art")
    assert len(synced_fds) == 2  # both files
    assert synced_dirs[-1] == tmp_path and {d.name for d in synced_dirs[:-1]} >= {"sub"}
    assert (tmp_path / "art" / "sub" / "g.onnx").read_bytes() == b"x"


def test_publishing_over_a_folder_swaps_them_in_one_step(tmp_path, monkeypatch):
    """Where the system can exchange two paths atomically (Linux renameat2), publishing over an old folder never
    renames it aside: `dest` names the old folder or the new one at every moment, a SIGKILL included."""
    probe_a, probe_b = tmp_path / "a", tmp_path / "b"
    probe_a.mkdir()
    probe_b.mkdir()
    if not atomic.exchange(probe_a, probe_b):
        pytest.skip("this system or file system cannot exchange two paths atomically")
    dest = tmp_path / "artifact"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with atomic.staging_folder(dest) as tmp:
        (tmp / "new.txt").write_text("new")

        def no_two_step_rename(*args, **kwargs):
            raise AssertionError("publish_folder renamed in two steps")

        monkeypatch.setattr(atomic.os, "replace", no_two_step_rename)
        atomic.publish_folder(tmp, dest)
        monkeypatch.undo()
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "artifact", "b"]  # the old folder is gone
