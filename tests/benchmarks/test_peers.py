"""benchmarks/peers.py on recorded worker output: parsing, tok/s without the prefill, rows, table, JSON,
bandwidth limits. No venv is built and no peer runs."""

import json
import sys
from pathlib import Path

import pytest
from helpers import script_module

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
WORKERS = PEERS.parent / "peer_workers"


@pytest.fixture(scope="module")
def peers():
    with script_module(PEERS) as module:
        yield module


# Recorded reply lines (shortened): llama.cpp stops at EOS (id 2) after 5 tokens, ort-genai runs to the limit.
READY = '{"ready": true, "modes": {"plain": "plain", "default": "mc26"}, "versions": {"clover-deploy": "0.1.0"}}'
REPLIES = {
    ("llama.cpp", "plain", 1, 0): '{"token_ids": [5, 6, 7, 8, 2], "prefill_s": 0.05, "decode_s": 0.04, "stats": {}}',
    ("llama.cpp", "plain", 1, 1): '{"token_ids": [9, 9, 9], "prefill_s": 0.07, "decode_s": 0.04, "stats": {}}',
    ("llama.cpp", "plain", 2, 0): '{"token_ids": [5, 6, 7, 8, 2], "prefill_s": 0.03, "decode_s": 0.08, "stats": {}}',
    ("llama.cpp", "plain", 2, 1): '{"token_ids": [9, 9, 9], "prefill_s": 0.05, "decode_s": 0.02, "stats": {}}',
    (
        "llama.cpp",
        "prompt-lookup",
        1,
        0,
    ): '{"token_ids": [5, 6, 7, 8, 2], "prefill_s": 0.05, "decode_s": 0.02, "stats": {}}',
    ("llama.cpp", "prompt-lookup", 1, 1): '{"token_ids": [9, 9, 4], "prefill_s": 0.05, "decode_s": 0.02, "stats": {}}',
    (
        "llama.cpp",
        "prompt-lookup",
        2,
        0,
    ): '{"token_ids": [5, 6, 7, 8, 2], "prefill_s": 0.05, "decode_s": 0.02, "stats": {}}',
    ("llama.cpp", "prompt-lookup", 2, 1): '{"token_ids": [9, 9, 9], "prefill_s": 0.05, "decode_s": 0.02, "stats": {}}',
}


def measurements(peers):
    ms, tokens = [], {}
    for (system, mode, rnd, prompt), line in REPLIES.items():
        r = peers.parse_reply(line, max_new_tokens=5, spec_name=system)
        m = peers.Measurement(
            system,
            "q4_1 gguf",
            mode,
            rnd,
            prompt,
            30,
            len(r.token_ids),
            r.token_ids[-1] == 2,
            r.prefill_s,
            r.decode_s,
            None,
            r.stats,
        )
        ms.append(m)
        tokens[(system, "q4_1 gguf", mode, rnd, prompt)] = r.token_ids
    return peers.identical_to_plain(ms, tokens, lambda s, p: "plain")


def test_parse_ready_and_reply(peers):
    assert peers.parse_ready(READY, "clover fp32")["modes"]["default"] == "mc26"
    r = peers.parse_reply(REPLIES[("llama.cpp", "plain", 1, 0)], 128, "llama.cpp")
    assert r.token_ids == (5, 6, 7, 8, 2) and r.prefill_s == 0.05 and r.decode_s == 0.04


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "exited mid-request"),
        ("llama_model_load: loading", "expected a JSON reply"),
        ('{"error": "RuntimeError: boom"}', "RuntimeError: boom"),
        ('{"token_ids": [], "prefill_s": 0.1, "decode_s": 0.1}', "expected 1 to 4 token ids"),
        ('{"token_ids": [1, 2, 3, 4, 5], "prefill_s": 0.1, "decode_s": 0.1}', "expected 1 to 4 token ids"),
        ('{"token_ids": [1, 2], "prefill_s": -1, "decode_s": 0.1}', "non-negative"),
    ],
)
def test_bad_replies_name_the_worker(peers, line, message):
    with pytest.raises(peers.PeerError, match=message) as e:
        peers.parse_reply(line, 4, "ort-genai int4")
    assert "ort-genai int4" in str(e.value)


def test_ready_line_errors(peers):
    with pytest.raises(peers.PeerError, match="exited before it was ready"):
        peers.parse_ready("", "x")
    with pytest.raises(peers.PeerError, match="no such file"):
        peers.parse_ready('{"ready": false, "error": "no such file"}', "x")


def test_decode_rate_excludes_the_prefill_token(peers):
    ms = measurements(peers)
    r1 = [m for m in ms if m.mode == "plain" and m.round == 1]
    # (5 - 1) + (3 - 1) tokens after the first, over 0.04 + 0.04 s; prefill times play no part
    assert peers.decode_rate(r1) == pytest.approx(6 / 0.08)
    one = [peers.Measurement("s", "p", "plain", 1, 0, 10, 1, True, 0.1, 0.0, None)]
    assert peers.decode_rate(one) is None  # EOS right after the prefill: nothing decoded


def test_rows_per_round_mean_prefill_and_identity(peers):
    rows = peers.aggregate(measurements(peers), {("llama.cpp", "q4_1 gguf"): 100_000_000}, 10.0, rounds=2)
    assert [(r.system, r.mode) for r in rows] == [("llama.cpp", "plain"), ("llama.cpp", "prompt-lookup")]
    plain, lookup = rows
    assert plain.tokens_per_s == pytest.approx((6 / 0.08, 6 / 0.10))
    assert plain.mean_tokens_per_s == pytest.approx((6 / 0.08 + 6 / 0.10) / 2)
    assert plain.prefill_ms == pytest.approx(50.0)
    assert plain.new_tokens == 16 and plain.stopped == 2 and plain.generations == 4
    assert plain.identical_to_plain is None  # plain is the reference
    assert lookup.identical_to_plain == "3/4"  # round 1, prompt 1 differs ([9, 9, 4])
    assert plain.limit_tokens_per_s == pytest.approx(100.0)  # 10 GB/s over 100 MB per forward
    assert plain.percent_of_limit == pytest.approx(plain.mean_tokens_per_s)


def test_bandwidth_limit_arithmetic(peers):
    assert peers.bandwidth_limit(12.0, 540_000_000) == pytest.approx(22.22, rel=1e-3)  # fp32 SmolLM2-135M
    assert peers.bandwidth_limit(12.0, 86_000_000) == pytest.approx(139.53, rel=1e-3)  # int4
    assert peers.bandwidth_limit(12.0, 0) is None
    bw = peers.Bandwidth(1 << 30, 3, {1: (8.0, 9.5, 9.0), 2: (11.0, 12.5, 12.0)})
    assert bw.best(2) == 12.5
    assert peers.limit_threads(bw, 2) == 2 and peers.limit_threads(bw, 8) == 2 and peers.limit_threads(bw, 1) == 1


def test_round_order_rotates(peers):
    assert peers.round_order(4, 0, 2) == [0, 1, 2, 3]
    assert peers.round_order(4, 1, 2) == [2, 3, 0, 1]
    assert peers.round_order(3, 1, 3) == [1, 2, 0]
    for r in range(3):
        assert sorted(peers.round_order(5, r, 3)) == list(range(5))


def test_table_and_json(peers):
    ms = measurements(peers)
    rows = peers.aggregate(ms, {("llama.cpp", "q4_1 gguf"): 100_000_000}, 10.0, rounds=2)
    table = peers.format_table(rows, 2).splitlines()
    assert table[0].startswith("| system | mode | precision | round 1 tok/s | round 2 tok/s | mean tok/s | prefill ms")
    assert len(table) == 2 + len(rows)
    assert table[2].split("|")[4].strip() == "75.0"  # plain, round 1: 6 tokens / 0.08 s
    assert table[3].split("|")[-3].strip() == "3/4" and table[3].split("|")[-2].strip() == "-"  # no ppl given
    bw = peers.Bandwidth(1 << 30, 2, {1: (9.0, 8.0), 2: (10.0, 9.0)})
    skipped = [peers.Skipped("clover", "int4", "export failed: unrecognized arguments: --weights int4")]
    settings = {"num_prompts": 2, "max_new_tokens": 5, "threads": 2}
    notes = peers.format_notes(bw, skipped, settings)
    assert "10.0 GB/s" in notes and "skipped clover int4: export failed" in notes
    doc = json.loads(json.dumps(peers.build_document(rows, ms, bw, skipped, settings, {"cpu": "x"}, {}, {})))
    assert doc["rows"][0]["tokens_per_s"] == pytest.approx([75.0, 60.0])
    assert doc["bandwidth"]["best_gbps"] == {"1": 9.0, "2": 10.0}
    assert doc["skipped"][0]["precision"] == "int4" and len(doc["measurements"]) == len(ms)


def test_plot_writes_a_png(peers, tmp_path):
    pytest.importorskip("matplotlib")
    rows = peers.aggregate(measurements(peers), {("llama.cpp", "q4_1 gguf"): 100_000_000}, 10.0, rounds=2)
    peers.plot(rows, tmp_path / "p.png", "test")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_worker_token_clock_stops_at_eos_or_limit(monkeypatch):
    monkeypatch.syspath_prepend(str(WORKERS))
    from protocol import TokenClock

    clock = TokenClock(max_new_tokens=4, stop_ids=[2])
    assert not clock.add([7, 8])
    assert clock.add([2, 9])  # a speculative step may overshoot: cut at EOS, kept
    g = clock.result()
    assert g.token_ids == [7, 8, 2] and g.prefill_s >= 0 and g.decode_s >= 0
    clock = TokenClock(max_new_tokens=2, stop_ids=[2])
    assert clock.add([5, 6, 7]) and clock.result().token_ids == [5, 6]
    with pytest.raises(RuntimeError, match="no token"):
        TokenClock(4, [2]).result()
    monkeypatch.delitem(sys.modules, "protocol")


def test_export_flags(peers):
    from clover.export.config import DEFAULT_QUANT
    from clover.tools.demo import shipped_corpora

    corpora = shipped_corpora("smollm2")
    store = ["--ngram-store", ",".join(map(str, corpora)) if corpora else "none"]
    assert peers.export_flags("fp32") == ["--attention", "fused", "--draft-quant", "int8", *store]
    quant, block, sym = DEFAULT_QUANT["int4"]  # clover-export's default, spelled out
    assert peers.export_flags("int4")[:6] == ["--attention", "fused", "--weights", "int4", "--quant", quant]
    assert (
        peers.export_flags("int4")[6:8] == ["--block-size", str(block)]
        and ("--symmetric" in peers.export_flags("int4")) == sym
    )
    assert peers.export_flags("int8-kquant-64") == [
        "--attention", "fused", "--weights", "int8", "--quant", "kquant", "--block-size", "64", *store
    ]  # fmt: skip
    assert "--symmetric" in peers.export_flags("int4-rtnsym-32")
    assert peers.clover_precisions("fp32,int4-gptq-32") == ("fp32", "int4-gptq-32")
    with pytest.raises(peers.argparse.ArgumentTypeError, match="WEIGHTS-QUANT"):
        peers.clover_precisions("int4-foo-32")


def test_rows_carry_the_perplexity_quality_measured(peers, tmp_path):
    ms = measurements(peers)
    rows = peers.aggregate(ms, {("llama.cpp", "q4_1 gguf"): 100_000_000}, 10.0, rounds=2)
    quality = tmp_path / "quality.json"
    quality.write_text(json.dumps({"rows": [{"system": "llama.cpp Q4_1 (shipped)", "sharegpt": {"perplexity": 12.5}}]}))
    rows = peers.with_perplexity(rows, quality)
    assert {r.perplexity for r in rows if r.system == "llama.cpp"} == {12.5}
    assert all(r.perplexity is None for r in rows if r.system != "llama.cpp")  # not measured there
    assert peers.format_table(rows, 2).splitlines()[2].split("|")[-2].strip() == "12.50"
    assert peers.quality_name("clover", "int4-kquant-32") == "clover int4-kquant-32"
    assert peers.quality_name("clover", "fp32") == "clover fp32"
    assert peers.quality_name("llama.cpp", "q8_0 gguf") == "llama.cpp Q8_0"
