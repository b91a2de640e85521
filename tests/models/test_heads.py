"""Draft heads (Medusa, Clover, Clover-2) on tiny random bases: checkpoint I/O, the begin/step
interface, augmenting-block cache consistency, training-start initialisation and depth limits.

Round trips are exact in fp32 and exact up to the fp16 rounding of the saved weights in fp16.
Chunked vs one-shot `begin` agree to atol 1e-5 (fp32).
"""

import json
import os

import pytest
import torch
from helpers import tiny_base
from numerics import assert_close_paths, assert_exact, chain_reduction
from safetensors.torch import load_file

from clover.errors import CloverError
from clover.models import head_io
from clover.models.decoder import causal_mask, rope_cos_sin
from clover.models.head_io import (
    CONFIG_FILE,
    FORMAT_VERSION,
    WEIGHTS_FILE,
    build_heads,
    load_heads,
    random_heads,
    resolve_heads,
    save_heads,
)
from clover.models.heads import ARCHITECTURES, BaseFingerprint

ARCHS = list(ARCHITECTURES)  # medusa, clover, clover2
CACHED = ["clover", "clover2"]  # the heads with an augmenting block (own KV cache)
ANOTHER_BASE = "trained for another base model"


@pytest.fixture(scope="module")
def base():
    return tiny_base(seed=0)


def trained_like(base, arch, seed=0, **kw):
    """Initialised heads with every parameter moved off its init (Medusa's init is all zeros), so a
    round trip that dropped or mixed up a tensor would show."""
    heads = build_heads(base, arch, **kw)
    gen = torch.Generator().manual_seed(seed)
    heads.init_weights(base, gen)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return heads.eval().requires_grad_(False)


def empty_head_cache(base, heads, length=0):
    """Per augmenting-block layer K and V [1, Hkv, length, D] (random: a past the heads wrote before)."""
    c = base.config
    gen = torch.Generator().manual_seed(length)
    make = lambda: torch.randn(1, c.num_kv_heads, length, c.head_dim, generator=gen)
    n = heads.num_cache_layers
    return [make() for _ in range(n)], [make() for _ in range(n)]


def accepted(base, n, seed=0):
    """What the runtime passes to begin after a prefill of n tokens: the base's pre-norm hidden states
    [1, n, H], each token's successor [1, n] (the last one is the bonus token), positions [1, n]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, base.config.vocab_size, (1, n + 1), generator=gen)
    k, v = base.empty_cache(1, 0)
    with torch.no_grad():
        out = base(ids[:, :n], torch.arange(n)[None], causal_mask(n), torch.tensor([0]), k, v)
    return out.hidden_states, ids[:, 1:], torch.arange(n)[None], out.logits


@torch.no_grad()
def run(heads, base, n=6, seed=0):
    """begin over n accepted tokens, then step depths 1..3 (capped by max_depth) over 2 nodes each."""
    hidden, nxt, pos = accepted(base, n, seed)[:3]
    pk, pv = empty_head_cache(base, heads)
    out = heads.begin(hidden, nxt, pos, torch.tensor([0]), pk, pv)
    results = [out.state, out.logits, *out.new_keys, *out.new_values]
    state = out.state.expand(2, -1)
    last = 3 if heads.config.max_depth is None else min(3, heads.config.max_depth - 1)
    for depth in range(1, last + 1):
        tokens = torch.tensor([3 + depth, 50 + depth])
        state, logits = heads.step(depth, state, tokens)
        results += [state, logits]
    return results


def assert_all_equal(got, want):
    """The same heads on the same inputs: the same kernels, so the same bits."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_exact(g, w)


def heads_reduction(base, heads) -> int:
    """The longest chain of summed terms behind a head's output: its augmenting layers, then the LM head."""
    return chain_reduction(base.config, layers=getattr(heads, "num_cache_layers", 0) + 1, context=8)


# --- 1. save -> load round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(base, arch, dtype, tmp_path):
    heads = trained_like(base, arch)
    folder = tmp_path / "heads"
    if dtype == torch.float16:
        save_heads(heads, folder)  # the default dtype
    else:
        save_heads(heads, folder, dtype=dtype)

    doc = json.loads((folder / CONFIG_FILE).read_text())
    assert doc["format_version"] == FORMAT_VERSION
    assert doc["arch"] == arch
    assert doc["dtype"] == str(dtype).removeprefix("torch.")
    assert (doc["num_heads"], doc["num_layers"]) == (heads.config.num_heads, heads.config.num_layers)
    assert doc["own_lm_head"] is False
    fp = BaseFingerprint.of(base)
    assert doc["base"] == {
        "architecture": "LlamaForCausalLM",
        "hidden_size": 64,
        "vocab_size": 96,
        "lm_head_sha256": fp.lm_head_sha256,
        "lm_head_probe": list(fp.lm_head_probe),
    }
    assert len(fp.lm_head_sha256) == 16

    # Only the heads' own parameters are stored: not the shared LM head nor the base's final norm.
    stored = load_file(str(folder / WEIGHTS_FILE))
    assert set(stored) == {name for name, _ in heads.named_parameters()}
    assert not any("lm_weight" in k or "base_norm" in k for k in stored)
    assert all(t.shape != base.lm_head.weight.shape for t in stored.values())
    assert all(t.dtype == dtype for t in stored.values())

    loaded = load_heads(folder, base)
    assert type(loaded) is type(heads) and loaded.config == heads.config
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert loaded.lm_weight.data_ptr() == base.lm_head.weight.data_ptr()  # shared, not copied
    assert loaded.base_norm_weight.data_ptr() == base.norm.weight.data_ptr()

    want_state = {k: v.to(dtype).float() for k, v in heads.state_dict().items()}
    got_state = loaded.state_dict()
    assert set(got_state) == set(want_state)
    for k in want_state:
        assert got_state[k].dtype == torch.float32  # rebuilt in the base's dtype
        assert_exact(got_state[k], want_state[k], msg=k)

    if dtype == torch.float32:
        assert_all_equal(run(loaded, base), run(heads, base))
    else:
        # Exactly the original with fp16-rounded weights, and close to the original itself.
        rounded = build_heads(base, arch)
        rounded.load_state_dict(want_state)
        assert_all_equal(run(loaded, base), run(rounded.eval(), base))
        # weights rounded once to fp16: each output moves by fp16 rounding over the last matmul's terms
        for g, w in zip(run(loaded, base), run(heads, base)):
            assert_close_paths(g, w, reduction=base.config.hidden_size, dtype=torch.float16)


def test_round_trip_medusa_own_lm_head(base, tmp_path):
    heads = trained_like(base, "medusa", num_heads=2, own_lm_head=True)
    save_heads(heads, tmp_path / "h", dtype=torch.float32)
    doc = json.loads((tmp_path / "h" / CONFIG_FILE).read_text())
    assert doc["own_lm_head"] is True and doc["num_heads"] == 2
    stored = load_file(str(tmp_path / "h" / WEIGHTS_FILE))
    assert {"lm_heads.0.weight", "lm_heads.1.weight"} <= set(stored)
    loaded = load_heads(tmp_path / "h", base)
    assert loaded.config.own_lm_head and len(loaded.lm_heads) == 2
    assert_all_equal(run(loaded, base), run(heads, base))


# --- 2. load errors and atomic save ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_load_on_another_base_raises(base, arch, tmp_path):
    save_heads(random_heads(base, arch), tmp_path / "h")
    other_seed = tiny_base(seed=1)
    assert BaseFingerprint.of(other_seed).lm_head_sha256 != BaseFingerprint.of(base).lm_head_sha256
    with pytest.raises(CloverError, match=ANOTHER_BASE):
        load_heads(tmp_path / "h", other_seed)
    with pytest.raises(CloverError, match=ANOTHER_BASE + r".*hidden 64.*this base.*hidden 32"):
        load_heads(tmp_path / "h", tiny_base(seed=0, hidden_size=32))
    with pytest.raises(CloverError, match=ANOTHER_BASE):
        resolve_heads(str(tmp_path / "h"), other_seed)


def test_load_errors_are_clear(base, tmp_path):
    with pytest.raises(CloverError, match=r"not a head checkpoint: no heads\.json"):
        load_heads(tmp_path, base)

    folder = tmp_path / "h"
    save_heads(random_heads(base, "clover"), folder)
    doc = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**doc, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(CloverError, match=rf"format version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}"):
        load_heads(folder, base)

    (folder / CONFIG_FILE).write_text(json.dumps(doc))
    load_heads(folder, base)  # restored: loads again
    (folder / WEIGHTS_FILE).unlink()
    with pytest.raises(CloverError, match=r"has no heads\.safetensors: the folder is incomplete"):
        load_heads(folder, base)


def test_save_replaces_folder_atomically(base, tmp_path, monkeypatch):
    folder = tmp_path / "heads"
    first, second = trained_like(base, "clover2", seed=1), trained_like(base, "clover2", seed=2)
    save_heads(first, folder, dtype=torch.float32)
    (folder / "training.json").write_text("provenance of the run")  # other files survive a new save
    save_heads(second, folder, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["heads"]  # no temporary folder left behind
    assert sorted(os.listdir(folder)) == [CONFIG_FILE, WEIGHTS_FILE, "training.json"]
    assert_all_equal(run(load_heads(folder, base), base), run(second, base))

    # A save that fails half-way leaves the previous checkpoint as it was, and no temporary folder.
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(head_io, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_heads(first, folder)
    assert sorted(os.listdir(tmp_path)) == ["heads"]
    assert (folder / "training.json").is_file()
    assert_all_equal(run(load_heads(folder, base), base), run(second, base))


# --- 3. resolve_heads --------------------------------------------------------------------------------


def test_resolve_heads_specs(base):
    assert resolve_heads("none", base) is None
    default = resolve_heads("random:clover2", base)
    seven = resolve_heads("random:clover2:7", base)
    assert default.config.arch == seven.config.arch == "clover2"
    assert not default.training and not any(p.requires_grad for p in default.parameters())

    def same(a, b):
        sa, sb = a.state_dict(), b.state_dict()
        return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    assert not same(default, seven)
    assert same(seven, resolve_heads("random:clover2:7", base))
    assert same(default, resolve_heads("random:clover2:0", base))  # the seed defaults to 0
    for arch in ARCHS:
        assert resolve_heads(f"random:{arch}", base).config.arch == arch


@pytest.mark.parametrize(
    "spec", ["random:gpt", "random:clover2:x", "random:clover2:1:2", "random:", "random", "does/not/exist"]
)
def test_resolve_heads_bad_specs(base, spec):
    with pytest.raises(CloverError, match=r"random:ARCH\[:SEED\]") as info:
        resolve_heads(spec, base)
    assert repr(spec) in str(info.value)
    if spec.startswith("random:"):
        assert "medusa, clover, clover2" in str(info.value)
    else:
        assert "head checkpoint folder" in str(info.value) and "none" in str(info.value)


def test_resolve_heads_folder(base, tmp_path):
    heads = trained_like(base, "medusa")
    save_heads(heads, tmp_path / "h", dtype=torch.float32)
    assert_all_equal(run(resolve_heads(str(tmp_path / "h"), base), base), run(heads, base))


# --- 4. interface shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_interface_shapes(base, arch):
    heads = random_heads(base, arch)
    c = base.config
    H, V, N, P = c.hidden_size, c.vocab_size, 5, 3
    hidden, nxt, _, _ = accepted(base, N)
    pk, pv = empty_head_cache(base, heads, P)
    with torch.no_grad():
        out = heads.begin(hidden, nxt, torch.arange(P, P + N)[None], torch.tensor([P]), pk, pv)
    assert out.state.shape == (1, H) and out.logits.shape == (1, V)
    assert out.state.dtype == out.logits.dtype == torch.float32
    if arch == "medusa":
        assert heads.num_cache_layers == 0 and out.new_keys == [] and out.new_values == []
    else:
        L = heads.num_cache_layers
        assert L == heads.config.num_layers == (1 if arch == "clover" else 2)
        assert len(out.new_keys) == len(out.new_values) == L
        for t in out.new_keys + out.new_values:
            assert t.shape == (1, c.num_kv_heads, N, c.head_dim)  # only the new rows, never the past

    for n in (1, 4):
        parent = torch.randn(n, H)
        with torch.no_grad():
            state, logits = heads.step(1, parent, torch.arange(n) + 10)
        assert state.shape == (n, H) and logits.shape == (n, V)


# --- 5. augmenting-block cache consistency -----------------------------------------------------------


@pytest.mark.parametrize("split", [1, 3, 6])
@pytest.mark.parametrize("arch", CACHED)
def test_chunked_begin_matches_one_shot(base, arch, split):
    heads = trained_like(base, arch)
    N = 7
    hidden, nxt, pos, _ = accepted(base, N, seed=3)
    pk, pv = empty_head_cache(base, heads)
    with torch.no_grad():
        full = heads.begin(hidden, nxt, pos, torch.tensor([0]), pk, pv)
        first = heads.begin(hidden[:, :split], nxt[:, :split], pos[:, :split], torch.tensor([0]), pk, pv)
        second = heads.begin(
            hidden[:, split:], nxt[:, split:], pos[:, split:], torch.tensor([split]), first.new_keys, first.new_values
        )
    K = heads_reduction(base, heads)
    assert_close_paths(second.state, full.state, reduction=K)
    assert_close_paths(second.logits, full.logits, reduction=K)
    for a, b, f in zip(
        first.new_keys + first.new_values, second.new_keys + second.new_values, full.new_keys + full.new_values
    ):
        assert_close_paths(torch.cat((a, b), dim=2), f, reduction=K)


@pytest.mark.parametrize("arch", CACHED)
def test_begin_token_by_token_matches_one_shot(base, arch):
    """As the runtime feeds a plain decode: one accepted token per step, the cache growing by one row."""
    heads = trained_like(base, arch, seed=4)
    N = 5
    hidden, nxt, pos, _ = accepted(base, N, seed=5)
    keys, values = empty_head_cache(base, heads)
    with torch.no_grad():
        full = heads.begin(hidden, nxt, pos, torch.tensor([0]), keys, values)
        for i in range(N):
            out = heads.begin(
                hidden[:, i : i + 1], nxt[:, i : i + 1], pos[:, i : i + 1], torch.tensor([i]), keys, values
            )
            keys = [torch.cat((k, nk), dim=2) for k, nk in zip(keys, out.new_keys)]
            values = [torch.cat((v, nv), dim=2) for v, nv in zip(values, out.new_values)]
    assert_close_paths(out.state, full.state, reduction=heads_reduction(base, heads))
    assert_close_paths(out.logits, full.logits, reduction=heads_reduction(base, heads))


@pytest.mark.parametrize("arch", CACHED)
def test_begin_ignores_cache_slots_past_past_lengths(base, arch):
    """A preallocated cache longer than past_lengths: the slots beyond it must not be attended."""
    heads = trained_like(base, arch)
    hidden, nxt, pos, _ = accepted(base, 4)
    pk, pv = empty_head_cache(base, heads, 2)
    junk_k, junk_v = empty_head_cache(base, heads, 3)
    with torch.no_grad():
        want = heads.begin(hidden[:, 2:], nxt[:, 2:], pos[:, 2:], torch.tensor([2]), pk, pv)
        got = heads.begin(
            hidden[:, 2:],
            nxt[:, 2:],
            pos[:, 2:],
            torch.tensor([2]),
            [torch.cat((a, 100 * b), 2) for a, b in zip(pk, junk_k)],
            [torch.cat((a, 100 * b), 2) for a, b in zip(pv, junk_v)],
        )
    assert_close_paths(got.logits, want.logits, reduction=heads_reduction(base, heads))


# --- 6. initialisation -------------------------------------------------------------------------------


def test_medusa_random_heads_start_as_the_base_lm_head(base):
    heads = random_heads(base, "medusa")
    hidden, nxt, pos, base_logits = accepted(base, 6)
    with torch.no_grad():
        out = heads.begin(hidden, nxt, pos, torch.tensor([0]), [], [])
        H = base.config.hidden_size
        assert_close_paths(out.state, base.norm(hidden[:, -1]), reduction=H)
        assert_close_paths(out.logits, base.lm_head(base.norm(hidden[:, -1])), reduction=H)
        # the base's logits came from its forward over 6 rows: another row count, another GEMM kernel
        assert_close_paths(out.logits, base_logits[:, -1], reduction=H)
        for depth in range(1, heads.config.num_heads):
            state, logits = heads.step(depth, out.state.expand(3, -1), torch.tensor([4, 5, 6]))
            assert_close_paths(state, out.state.expand(3, -1), reduction=H)
            assert_close_paths(logits, out.logits.expand(3, -1), reduction=H)


@pytest.mark.parametrize("arch", CACHED)
def test_augmenting_block_starts_as_the_base_last_layer(base, arch):
    heads = random_heads(base, arch, seed=3)
    want = base.layers[-1].state_dict()
    for layer in heads.augment.layers:
        got = layer.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert all(p.data_ptr() != q.data_ptr() for p, q in zip(layer.parameters(), base.layers[-1].parameters()))
    assert torch.equal(heads.augment.norm.weight, base.norm.weight)
    if arch == "clover2":
        assert torch.equal(heads.head_norm.weight, base.norm.weight)
    else:
        # Clover's augmenting block is then the base's last layer run again: on a one-token input
        # with no past, both produce the same output.
        x = torch.randn(1, 1, base.config.hidden_size)
        with torch.no_grad():
            k, v = empty_head_cache(base, heads)
            pos = torch.zeros(1, 1, dtype=torch.long)
            a = heads.augment(x, pos, torch.tensor([0]), k, v)[0]
            cos, sin = rope_cos_sin(base.inv_freq, pos, x.dtype)
            b = base.norm(base.layers[-1](x, cos, sin, torch.ones(1, 1, 1, 1, 1, dtype=torch.bool), k[0], v[0])[0])
        assert_close_paths(a, b, reduction=chain_reduction(base.config, layers=1, context=1))


def test_clover2_fc_layers_are_identity_plus_small_uniform_noise(base):
    heads = random_heads(base, "clover2", seed=5)
    H = base.config.hidden_size
    eye = torch.eye(H)
    for name, lin in [
        ("fc0", heads.fc0),
        ("fc", heads.fc),
        ("fuse.q", heads.fuse.q),
        ("fuse.k", heads.fuse.k),
        ("rnn.q", heads.rnn.q),
        ("rnn.k", heads.rnn.k),
    ]:
        w = lin.weight
        target = torch.cat((eye, torch.zeros(H, w.shape[1] - H)), dim=1)  # [I | 0]
        noise = w - target
        assert noise.min() >= 0 and noise.max() <= 0.01, name
        assert noise.std() > 1e-3, name  # really noisy, not the bare identity
        assert torch.equal(lin.bias, torch.zeros(H)), name
    assert heads.fc.weight.shape == (H, 2 * H)
    for v in (heads.fuse.v, heads.rnn.v):
        assert 0 <= v.weight.min() and v.weight.max() <= 0.01


def test_medusa_own_lm_heads_start_as_the_base_lm_head(base):
    heads = build_heads(base, "medusa", own_lm_head=True)
    heads.init_weights(base, torch.Generator().manual_seed(0))
    assert len(heads.lm_heads) == heads.config.num_heads == 4
    for head in heads.lm_heads:
        assert torch.equal(head.weight, base.lm_head.weight)
        assert head.weight.data_ptr() != base.lm_head.weight.data_ptr()  # own copies, trainable apart
    hidden, nxt, pos, base_logits = accepted(base, 3)
    with torch.no_grad():
        out = heads.begin(hidden, nxt, pos, torch.tensor([0]), [], [])
    assert_close_paths(out.logits, base_logits[:, -1], reduction=base.config.hidden_size)


# --- 7. depth limits ---------------------------------------------------------------------------------


def test_max_depth(base):
    assert random_heads(base, "medusa").config.max_depth == 4
    assert random_heads(base, "clover").config.max_depth == 3
    assert build_heads(base, "clover", num_heads=5).config.max_depth == 5
    assert build_heads(base, "medusa", num_heads=2).config.max_depth == 2
    assert random_heads(base, "clover2").config.max_depth is None


def test_clover2_drafts_any_depth(base):
    heads = trained_like(base, "clover2")
    hidden, nxt, pos, _ = accepted(base, 4)
    pk, pv = empty_head_cache(base, heads)
    tokens = torch.tensor([7, 8])
    with torch.no_grad():
        state = heads.begin(hidden, nxt, pos, torch.tensor([0]), pk, pv).state.expand(2, -1)
        for depth in range(1, 11):
            state, logits = heads.step(depth, state, tokens)
            assert state.shape == (2, 64) and logits.shape == (2, 96)
            assert torch.isfinite(logits).all()
        # One recurrent head shared by every depth: the depth argument changes nothing.
        for a, b in zip(heads.step(10, state, tokens), heads.step(1, state, tokens)):
            assert_exact(a, b)


# --- regressions of bugs found while writing these tests ---------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_heads_load_on_the_same_base_in_another_dtype(base, tmp_path, dtype):
    save_heads(random_heads(base, "clover"), tmp_path / "h")
    heads = load_heads(tmp_path / "h", tiny_base(seed=0).to(dtype))
    assert heads.lm_weight.dtype == dtype


def test_resolve_heads_superscript_seed_is_a_clover_error(base):
    with pytest.raises(CloverError, match=r"random:ARCH\[:SEED\]"):
        resolve_heads("random:clover2:\u00b2", base)


def test_saved_folder_is_readable_by_others(base, tmp_path):
    save_heads(random_heads(base, "medusa"), tmp_path / "h")
    assert (tmp_path / "h").stat().st_mode & 0o055 == 0o055 & ~_umask()


def _umask():
    import os

    m = os.umask(0)
    os.umask(m)
    return m


def test_corrupt_or_incomplete_config_is_a_clover_error(base, tmp_path):
    save_heads(random_heads(base, "medusa"), tmp_path / "h")
    cfg = tmp_path / "h" / CONFIG_FILE
    doc = json.loads(cfg.read_text())
    cfg.write_text("{not json")
    with pytest.raises(CloverError, match="not valid JSON"):
        load_heads(tmp_path / "h", base)
    del doc["base"]
    cfg.write_text(json.dumps(doc))
    with pytest.raises(CloverError, match="incomplete or malformed"):
        load_heads(tmp_path / "h", base)


@pytest.mark.parametrize("arch,own", [("medusa", False), ("medusa", True), ("clover", False), ("clover2", False)])
def test_over_vocab_drafts_the_vocabularys_columns(base, arch, own):
    """heads.over_vocab(ids): the same parameters, draft logits over the K ids only (begin and step), equal to the
    full logits' columns within the path tolerance (a matmul over K rows instead of V); the heads themselves unchanged."""
    heads = trained_like(base, arch, own_lm_head=own) if own else trained_like(base, arch)
    ids = torch.arange(0, base.config.vocab_size, 3)
    small = heads.over_vocab(ids)
    assert all(a is b for a, b in zip(small.parameters(), heads.parameters()))
    H, N = base.config.hidden_size, 4
    g = torch.Generator().manual_seed(0)
    hidden, nxt = torch.randn(1, N, H, generator=g), torch.randint(0, base.config.vocab_size, (1, N), generator=g)
    args = (
        hidden,
        nxt,
        torch.arange(N)[None],
        torch.zeros(1, dtype=torch.long),
        *base.empty_cache(1, 0, heads.num_cache_layers),
    )
    with torch.inference_mode():
        full, part = heads.begin(*args), small.begin(*args)
        assert part.logits.shape[-1] == len(ids) and full.logits.shape[-1] == base.config.vocab_size
        assert_close_paths(part.logits, full.logits[..., ids], reduction=H)
        tokens = torch.tensor([5, 9])
        (_, f), (_, p) = (
            heads.step(1, full.state.expand(2, -1), tokens),
            small.step(1, full.state.expand(2, -1), tokens),
        )
        assert_close_paths(p, f[..., ids], reduction=H)
