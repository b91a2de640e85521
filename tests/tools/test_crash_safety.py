"""benchmarks/crash_safety.py in short: clover-export (the fused tiny export, ~3 s) and clover-data grow SIGKILLed at
2 random moments each, killed at the two narrow windows random kills rarely hit, and given a destination on a
device too small for it (a tmpfs where mounting is permitted, else a file size limit). The benchmark runs 20 kills
each; the checks are its own."""

import errno
import random
from pathlib import Path

import pytest
from helpers import script_module

from clover import atomic
from clover.errors import CloverError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "crash_safety.py"
SEED = 0  # of the kill moments (the moments still depend on this machine's speed)
KILLS = 2
GROW_TOKENS = 600  # response tokens a grow run adds: ~11 shards, ~0.5 s


@pytest.fixture(scope="module")
def cs():
    with script_module(SCRIPT) as module:
        yield module


@pytest.fixture(scope="module")
def refs(cs, base_dir, tmp_path_factory):
    """One uninterrupted export of each variant (fused, --max-batch 2 and 4): what the kills are checked against."""
    return cs.reference_exports(str(base_dir), tmp_path_factory.mktemp("references"), cs.FUSED_VARIANTS)


@pytest.fixture(scope="module")
def answering(cs, refs, tmp_path_factory):
    """(artifact, prompts) for clover-data grow: a reference export (only read) and 600 one-turn prompts."""
    return refs.paths[0], cs.write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 600)


def test_export_killed_at_random_moments_leaves_the_old_or_the_new_artifact(cs, refs, tmp_path):
    print(f"seed {SEED}")
    r = cs.export_kills(refs, tmp_path, KILLS, random.Random(SEED))
    assert [k["state"] for k in r["kills"] if k["state"] not in ("old", "new")] == [], r["kills"]
    assert r["next_run"]["state"] == "new" and r["next_run"]["left"] == [], r  # the next run swept the rest


def test_grow_killed_at_random_moments_keeps_every_shard_whole(cs, answering, tmp_path):
    print(f"seed {SEED}")
    r = cs.grow_kills(*answering, tmp_path, KILLS, random.Random(SEED), GROW_TOKENS)
    assert [k["state"] for k in r["kills"] if k["state"] not in ("old", "grown", "new")] == [], r["kills"]
    assert r["next_run"]["left"] == [], r  # no temporary file, no shard the provenance does not list
    assert r["answers_equal_uninterrupted"] and r["compared_answers"] == r["next_run"]["answers"] > 0, r


def test_export_killed_as_it_publishes_leaves_the_old_artifact(cs, refs, tmp_path):
    """Killed at the publishing step: with an atomic exchange (Linux) the old artifact is still under its name; without
    one the old artifact was moved aside and the next export's sweep moves it back (it used to delete it with the
    staging folders)."""
    from clover import atomic

    probe = [tmp_path / "probe" / "a", tmp_path / "probe" / "b"]
    for p in probe:
        p.mkdir(parents=True)
    swaps = atomic.exchange(*probe)
    (tmp_path / "export").mkdir()
    w = cs.kill_between_renames(refs, tmp_path / "export")
    after_kill = "old; beside it: .tmp-art-" if swaps else "absent; beside it: .old-art-"
    assert w["returncode"] == -9 and w["after_kill"].startswith(after_kill), w
    assert w["passed"], w


def test_grow_killed_creating_a_corpus_does_not_block_the_next_one(cs, answering, tmp_path):
    """Only a temporary provenance file in the new corpus's folder: the next grow starts the corpus (it used to refuse
    the folder as not empty)."""
    w = cs.kill_creating_corpus(*answering, tmp_path, GROW_TOKENS)
    assert w["returncode"] == -9 and w["after_kill"].startswith(".provenance.json."), w
    assert w["passed"], w


@pytest.mark.parametrize("replace", [False, True], ids=["new", "replacing"])
def test_export_on_a_full_device_is_one_line_and_leaves_nothing_new(cs, refs, tmp_path, replace):
    r = cs.full_device_export(refs, tmp_path, replace)
    print(r.device, r.error)
    assert r.passed, r


def test_grow_on_a_full_device_is_one_line_and_keeps_the_shards_written(cs, answering, tmp_path):
    corpus = tmp_path / "corpus"
    cs.completed(cs.grow_argv(*answering, corpus, GROW_TOKENS))
    r = cs.full_device_grow(*answering, corpus, tmp_path, GROW_TOKENS)
    print(r.device, r.error, r.left)
    assert r.passed, r


def test_a_write_without_room_is_one_error_naming_it(tmp_path, monkeypatch):
    """ENOSPC / EDQUOT / EFBIG anywhere in the exception chain; an errno-less OSError (numpy's tofile, under
    torch.onnx) only when the device is nearly full; never a Ctrl-C."""
    path = tmp_path / "shard.npz"
    with pytest.raises(CloverError, match=f"^no space left on device writing {path}: free space there"):
        with atomic.replacing(path) as f:
            f.write(b"x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []
    dest = tmp_path / "art"
    for free, raised, message in (
        (1 << 30, RuntimeError, "^torch.onnx.export failed$"),
        (4096, CloverError, f"^no space left on device writing {dest}: free space there"),
    ):
        monkeypatch.setattr(atomic, "free_bytes", lambda folder, free=free: free)
        with pytest.raises(raised, match=message):
            with atomic.staging_folder(dest):
                try:
                    raise OSError("problem writing element 2048 to file")
                except OSError as e:
                    raise RuntimeError("torch.onnx.export failed") from e
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        with atomic.staging_folder(dest):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise KeyboardInterrupt from None
