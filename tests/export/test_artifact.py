"""The artifact directory: manifest contents and checksums, atomic writes, overwrite rules, and the
validation errors a runtime raises on a damaged or mismatched artifact."""

import dataclasses
import json
import os
import shutil

import pytest
from helpers import tiny_base, tiny_tokenizer_dir
from ort_helpers import tiny_artifact, tiny_modules

from clover.artifact import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    EngineSpec,
    ProfileSpec,
    file_entries,
    is_artifact,
    open_artifact,
    read_manifest,
    sha256_file,
    write_manifest,
)
from clover.errors import CloverError
from clover.export import artifact as export_artifact_module
from clover.export.artifact import ArtifactOptions, artifact_from_modules, check_target
from clover.export.config import ExportConfig
from clover.models.config import BaseConfig
from clover.models.heads import BaseFingerprint
from clover.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def clover2(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2")


@pytest.fixture
def copy(clover2, tmp_path):
    """A private copy of the clover2 artifact to damage."""
    return shutil.copytree(clover2, tmp_path / "art")


def edit_manifest(root, change):
    doc = json.loads((root / MANIFEST_FILE).read_text())
    change(doc)
    (root / MANIFEST_FILE).write_text(json.dumps(doc))


# -- what export writes --------------------------------------------------------------------------------


def test_manifest_describes_everything(clover2):
    m = read_manifest(clover2)
    base, heads = tiny_modules("clover2")
    assert m.format_version == FORMAT_VERSION and m.backend == "onnx" and m.dtype == "float32"
    assert m.attention == "portable" and m.opset == 20 and m.max_context == base.config.max_position_embeddings
    assert BaseConfig.from_dict(m.base_config) == base.config  # the artifact carries its config
    fp = m.base_fingerprint
    assert BaseFingerprint(**dict(fp, lm_head_probe=tuple(fp["lm_head_probe"]))) == BaseFingerprint.of(base)
    assert m.heads.arch == "clover2" and m.heads.name == "random:clover2:0" and m.heads.max_depth is None
    assert m.heads.num_layers == heads.config.num_layers
    # no --tree: the fastest of plain and the candidate trees, then of it, prompt lookup, and both, timed on these
    # graphs at export
    timing, trees = m.tree_timing, {"plain", "chain-1", "chain-2", "chain-3", "small", "mc26"}
    tps, versus = timing["tokens_per_second"], timing["versus_lookup"]
    merged = {f"{m.tree.name}+lookup"} if m.tree.name != "plain" else set()
    assert set(tps) == trees and set(versus) == {m.tree.name, "lookup"} | merged
    assert all(v > 0 for v in [*tps.values(), *versus.values()])
    assert m.tree.name == max(trees, key=tps.get)
    assert timing["chosen"] == max(versus, key=versus.get)
    assert (
        m.drafts == timing["drafts"] == {"lookup": "lookup", m.tree.name: "heads"}.get(timing["chosen"], "heads+lookup")
    )
    assert set(m.graphs) == {"base", "draft_begin", "draft_step", "lm_head"}  # one LM head (test_lm_head.py)
    assert {"torch", "onnx", "onnxscript", "clover-deploy", "python"} <= m.tools.keys()
    assert all(err < 1e-3 for g in m.parity.values() for err in g.values()), m.parity
    # every file but the manifest is listed with its checksum, and nothing else is there
    on_disk = {p.relative_to(clover2).as_posix() for p in clover2.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert set(m.files) == on_disk
    assert {"base.onnx", "base.onnx.data", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= on_disk
    for rel, entry in m.files.items():
        assert entry["sha256"] == sha256_file(clover2 / rel) and entry["bytes"] == (clover2 / rel).stat().st_size
    tok = Tokenizer.from_dir(clover2 / m.tokenizer)
    assert tok.encode("w7 w8") == [7, 8] and tok.eos_token_ids == (1,)
    open_artifact(clover2)  # validates


def test_plain_artifact_and_options(tmp_path):
    base, _ = tiny_modules("none")
    tok = tiny_tokenizer_dir(tmp_path / "tok")
    out = artifact_from_modules(
        base, None, tok, tmp_path / "plain", ExportConfig(max_context=64, opset=18, verify=False)
    )
    m = open_artifact(out)
    assert m.heads is None and m.tree is None and set(m.graphs) == {"base"} and m.parity == {}
    assert m.max_context == 64 and m.opset == 18


def base_tokenizer_dir(path):
    """The tiny tokenizer as a base model ships it: no chat template."""
    folder = tiny_tokenizer_dir(path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_manifest_records_whether_the_tokenizer_has_a_chat_template(clover2, tmp_path):
    """A base model exports (its tokenizer has no template: the export says so and records it), --chat-template
    stores one, and a manifest from before the field reads as it did (None: the tokenizer files tell)."""
    assert read_manifest(clover2).chat_template is True
    base, _ = tiny_modules("none")
    tok = base_tokenizer_dir(tmp_path / "tok")
    lines = []
    config = ExportConfig(max_context=64, verify=False)
    out = artifact_from_modules(base, None, tok, tmp_path / "base", config, ArtifactOptions(progress=lines.append))
    m = open_artifact(out)
    assert m.chat_template is False and not Tokenizer.from_dir(out / m.tokenizer).has_chat_template
    assert any("no chat template (a base model)" in line and "--chat-template" in line for line in lines)

    template = "{% for m in messages %}w6 {{ m['content'] }} {% endfor %}w7"
    lines.clear()
    given = ArtifactOptions(chat_template=template, progress=lines.append)
    out = artifact_from_modules(base, None, tok, tmp_path / "templated", config, given)
    m = open_artifact(out)
    stored = Tokenizer.from_dir(out / m.tokenizer)
    assert m.chat_template is True and any("with the chat template given" in line for line in lines)
    assert stored.encode_chat([{"role": "user", "content": "w9"}]) == [6, 9, 7]
    assert "chat_template" not in json.loads((out / m.tokenizer / "tokenizer_config.json").read_text())
    # a template that is not Jinja fails at once, before a graph is written
    with pytest.raises(CloverError, match="not valid Jinja"):
        bad = ArtifactOptions(chat_template="{% for %}")
        artifact_from_modules(base, None, tok, tmp_path / "bad", config, bad)
    assert not (tmp_path / "bad").exists()

    edit_manifest(out, lambda d: d.pop("chat_template"))
    assert read_manifest(out).chat_template is None
    edit_manifest(out, lambda d: d.update(chat_template="yes"))
    with pytest.raises(CloverError, match="incomplete or malformed"):
        read_manifest(out)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"backend": "tflite"}, "unknown export backend"),
        ({"dtype": "int8"}, "unsupported export dtype"),
        ({"attention": "flash"}, "unknown attention variant"),
        ({"max_prompt": 64}, "use it with --backend trt"),
        ({"backend": "trt", "max_prompt": 0}, "at least 1 token"),
        ({"opset": 13}, "opset 13 is not supported"),
        ({"max_context": 1}, "at least 2"),
    ],
)
def test_export_config_rejects(kwargs, message):
    with pytest.raises(CloverError, match=message):
        ExportConfig(**kwargs)


def test_export_rejects_inconsistent_requests(tmp_path):
    base, heads = tiny_modules("clover")
    tok = tiny_tokenizer_dir(tmp_path / "tok")
    cases = [
        (base, heads, ExportConfig(tree="mc26"), "tree mc26 has depth 5 but clover heads draft at most 3"),
        (base, None, ExportConfig(tree="small"), "needs draft heads"),
        (base, None, ExportConfig(max_context=100_000), "exceeds the base model's max_position_embeddings"),
        (base, None, ExportConfig(dtype="float16"), "base model is float32"),
    ]
    for b, h, cfg, message in cases:
        with pytest.raises(CloverError, match=message):
            artifact_from_modules(b, h, tok, tmp_path / "out", cfg)
    with pytest.raises(CloverError, match="no tokenizer.json"):
        artifact_from_modules(base, None, tmp_path, tmp_path / "out", ExportConfig(verify=False))
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


# -- atomic writes and overwrite rules ------------------------------------------------------------------


def test_refuses_to_overwrite_a_folder_that_is_not_an_artifact(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("keep me")
    (tmp_path / "data" / MANIFEST_FILE).write_text('{"kind": "something else"}')
    base, _ = tiny_modules("none")
    with pytest.raises(CloverError, match="not a clover artifact"):
        artifact_from_modules(base, None, tiny_tokenizer_dir(tmp_path / "tok"), tmp_path / "data", ExportConfig())
    assert (tmp_path / "data" / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(CloverError, match="is a file"):
        check_target(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    check_target(tmp_path / "empty")  # an empty folder is fine


def test_reexport_replaces_an_artifact_whole_and_a_failed_export_leaves_it_intact(tmp_path, monkeypatch):
    base, _ = tiny_modules("none")
    tok = tiny_tokenizer_dir(tmp_path / "tok")
    out = tmp_path / "art"
    artifact_from_modules(base, None, tok, out, ExportConfig(verify=False))
    (out / "stale.txt").write_text("from an older export")
    first = read_manifest(out)

    other, _ = tiny_modules("none", base_seed=4)
    artifact_from_modules(other, None, tok, out, ExportConfig(verify=False, max_context=100))
    m = open_artifact(out)
    assert m.max_context == 100 and m.base_fingerprint != first.base_fingerprint
    assert not (out / "stale.txt").exists()

    def fail(*args, **kwargs):
        raise CloverError("simulated failure in the middle of an export")

    monkeypatch.setattr(export_artifact_module, "file_entries", fail)  # after the graphs are written
    with pytest.raises(CloverError, match="simulated"):
        artifact_from_modules(base, None, tok, out, ExportConfig(verify=False))
    assert open_artifact(out).max_context == 100  # the previous artifact, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "tok"]  # no temp folders left behind


def test_a_folder_without_manifest_is_never_an_artifact(copy):
    (copy / MANIFEST_FILE).unlink()
    assert not is_artifact(copy)
    with pytest.raises(CloverError, match="is not a clover artifact: it has no manifest.json"):
        open_artifact(copy)


# -- validation on load ---------------------------------------------------------------------------------


def test_missing_file(copy):
    (copy / "draft_step.onnx.data").unlink()
    with pytest.raises(CloverError, match="is missing draft_step.onnx.data"):
        open_artifact(copy)


def test_checksum_mismatch(copy):
    data = bytearray((copy / "base.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte differs
    (copy / "base.onnx.data").write_bytes(bytes(data))
    with pytest.raises(CloverError, match="base.onnx.data does not match its checksum"):
        open_artifact(copy)
    open_artifact(copy, checksums=False)  # sizes only: for fast loads of trusted files
    with open(copy / "tokenizer" / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(CloverError, match="tokenizer/tokenizer.json does not match"):
        open_artifact(copy, checksums=False)


def test_unknown_manifest_version(copy):
    edit_manifest(copy, lambda d: d.update(format_version=99))
    with pytest.raises(
        CloverError, match=f"manifest format version 99, this clover-deploy reads version {FORMAT_VERSION}"
    ):
        open_artifact(copy)


def test_heads_for_another_base(copy):
    other = dataclasses.asdict(BaseFingerprint.of(tiny_base(seed=11)))
    edit_manifest(copy, lambda d: d["heads"].update(base=other))
    with pytest.raises(CloverError, match="clover2 heads .* were trained for another base model"):
        open_artifact(copy)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda root: (root / MANIFEST_FILE).write_text("{not json"), "not valid JSON"),
        (lambda root: edit_manifest(root, lambda d: d.pop("graphs")), "incomplete or malformed"),
        (
            lambda root: edit_manifest(root, lambda d: d["files"].pop("draft_begin.onnx")),
            "which manifest.json does not list",
        ),
    ],
)
def test_corrupt_manifest(copy, damage, message):
    damage(copy)
    with pytest.raises(CloverError, match=message):
        open_artifact(copy)


def _outside_reads(root):
    """An audit hook on open(): the paths outside `root` that were opened while the hook was on (Python's audit
    hooks cannot be removed, so the hook reads a switch)."""
    import sys

    seen, state = [], {"on": False}

    def hook(event, args):
        if state["on"] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(args[0]))
            if (
                p.startswith("/")
                and not p.startswith(os.path.realpath(root))
                and "site-packages" not in p
                and not p.startswith(sys.prefix)
                and not p.startswith(sys.base_prefix)
            ):
                seen.append(p)

    sys.addaudithook(hook)
    return seen, state


@pytest.mark.parametrize(
    "craft,message",
    [
        (
            lambda root: edit_manifest(root, lambda d: d["files"].update({"../secret": {"sha256": "0", "bytes": 1}})),
            "not a relative path inside the artifact",
        ),
        (
            lambda root: edit_manifest(
                root, lambda d: d["files"].update({"/etc/hostname": {"sha256": "0", "bytes": 1}})
            ),
            "not a relative path inside the artifact",
        ),
        (
            lambda root: edit_manifest(root, lambda d: d["graphs"]["base"].update(file="../outside.onnx")),
            "not a relative path inside the artifact",
        ),
        (
            lambda root: (
                os.replace(root / "base.onnx", root / "base.moved"),
                os.symlink("/etc/hostname", root / "base.onnx"),
            ),
            "resolves outside the artifact",
        ),
        (
            lambda root: edit_manifest(root, lambda d: d["graphs"]["base"].update(file="unlisted.onnx")),
            "which manifest.json does not list",
        ),
        (
            lambda root: edit_manifest(root, lambda d: d["graphs"]["base"].update(file=["a", "b"])),
            "not a relative path inside the artifact",
        ),
    ],
)
def test_crafted_manifests_are_refused_at_load_without_reading_outside(copy, craft, message):
    """An artifact is a trust boundary: a manifest that names a path outside the folder (traversal, an absolute
    path, a symlink out, an unlisted graph) is one CloverError line at load, and nothing outside is opened."""
    craft(copy)
    seen, state = _outside_reads(copy)
    state["on"] = True
    try:
        with pytest.raises(CloverError, match=message) as e:
            open_artifact(copy)
    finally:
        state["on"] = False
    assert "\n" not in str(e.value)
    assert not [p for p in seen if p.startswith("/etc") or "secret" in p or "outside" in p], seen


def test_mutated_manifest_paths_load_or_fail_with_one_clover_error(clover2, tmp_path):
    """Property-based (hypothesis): any string put where the manifest names a file (a listed file's key, the base
    graph's file, its external data) gives a loaded artifact or one CloverError line, never another exception, and
    nothing outside the folder is opened."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    root = shutil.copytree(clover2, tmp_path / "art")
    original = (root / MANIFEST_FILE).read_text()
    seen, state = _outside_reads(root)
    crafted = [
        "../x",
        "/etc/hostname",
        "a/../../b",
        "./base.onnx",
        "base.onnx/",
        "C:\\x",
        "\x00",
        "~/x",
        "tokenizer/..",
        "\ud800",
        "x" * 300,
    ]
    paths = st.one_of(st.text(max_size=40), st.sampled_from(crafted))
    where = st.sampled_from(["files", "graph", "external"])

    @given(path=paths, where=where)
    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def mutate(path, where):
        doc = json.loads(original)
        if where == "files":
            doc["files"][path] = doc["files"].pop("base.onnx")
        elif where == "graph":
            doc["graphs"]["base"]["file"] = path
        else:
            doc["graphs"]["base"]["external_data"] = [path]
        (root / MANIFEST_FILE).write_text(json.dumps(doc))
        state["on"] = True
        try:
            open_artifact(root, checksums=False)
        except CloverError as e:
            assert "\n" not in str(e)
        finally:
            state["on"] = False

    mutate()
    assert not [p for p in seen if p.startswith(("/etc", os.path.expanduser("~")))], seen


def test_errors_are_one_line(copy, tmp_path):
    (copy / "base.onnx").unlink()
    for path in (copy, tmp_path / "nope", tmp_path):
        with pytest.raises(CloverError) as e:
            open_artifact(path)
        assert "\n" not in str(e.value)


def test_engine_entries_round_trip_and_are_checked(copy):
    """A TensorRT artifact lists its engines with the profiles, precision, TensorRT version and GPU they were
    built for; an engine file must be listed (and checksummed) like every other file."""
    (copy / "engines").mkdir()
    (copy / "engines" / "base.engine").write_bytes(b"serialized engine")
    profiles = (
        ProfileSpec("prefill", {"input_ids": ((1, 1), (1, 64), (1, 512))}),
        ProfileSpec("verify", {"input_ids": ((1, 1), (1, 26), (1, 26))}),
    )
    engine = EngineSpec("base", "engines/base.engine", profiles, "float16", "10.13.0", "NVIDIA H100 80GB HBM3", "9.0")
    manifest = dataclasses.replace(
        read_manifest(copy), backend="trt", engines={"base": engine}, files=file_entries(copy)
    )
    write_manifest(copy, manifest)
    assert open_artifact(copy).engines == {"base": engine}
    doc = json.loads((copy / MANIFEST_FILE).read_text())
    assert doc["engines"]["base"]["profiles"][1]["shapes"]["input_ids"] == [[1, 1], [1, 26], [1, 26]]
    unlisted = dict(manifest.files)
    del unlisted["engines/base.engine"]
    write_manifest(copy, dataclasses.replace(manifest, files=unlisted))
    with pytest.raises(CloverError, match="engine base needs engines/base.engine, which manifest.json does not list"):
        open_artifact(copy)
