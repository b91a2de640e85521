"""clover-bench on a tiny random base: the table, the JSON, identity to plain decoding, errors."""

import json

import pytest
from helpers import tiny_hf_folder

from clover.runtime.params import GenerationParams
from clover.tools.bench import load_prompts
from clover.tools.bench import main as bench_main


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("bench") / "base")


def test_bench_table_and_json(base, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{10 + i} w{20 + i} w30"}) for i in range(3)) + "\n")
    out = tmp_path / "r" / "bench.json"
    rc = bench_main(
        [
            "--base",
            str(base),
            "--heads",
            "random:medusa,random:clover2",
            "--tree",
            "chain-3",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "accept len" in table and "random:clover2" in table and "bonus token included" in table
    doc = json.loads(out.read_text())
    assert doc["num_prompts"] == 3
    rows = {r["heads"]: r for r in doc["results"]}
    assert set(rows) == {"none", "random:medusa", "random:clover2"}
    assert rows["none"]["acceptance_length"] == 1.0 and rows["none"]["speedup"] == 1.0
    for r in rows.values():
        assert r["identical_to_plain"] == "3/3" and not r["mismatches"]
        assert len(r["acceptance_rate_per_depth"]) == 3
        assert r["latency_p95_ms"] >= r["latency_p50_ms"] > 0
        rates = r["acceptance_rate_per_depth"]
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # accepting d tokens implies accepting d-1
        # where a verify step's time goes: phases, the engine's part of them, and the host's share
        ms = r["step_ms"]
        assert set(ms) == {"draft", "verify", "accept", "commit", "engine"}
        assert 0 < ms["engine"] < sum(ms[p] for p in ("draft", "verify", "accept", "commit"))
        assert 0 < r["host_share"] < 1
    assert rows["none"]["step_ms"]["draft"] < rows["random:clover2"]["step_ms"]["draft"]  # plain drafts nothing
    assert "engine ms" in table and "host" in table


def test_several_trees_in_one_run(base, tmp_path, capsys):
    """--tree a,b: every head set on each tree, against one plain baseline per backend."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w20 w30"}) + "\n")
    out = tmp_path / "bench.json"
    rc = bench_main(
        [
            "--base",
            str(base),
            "--heads",
            "random:clover2",
            "--tree",
            "chain-2,small,[[0],[1]]",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [(r["heads"], r["tree"]) for r in doc["results"]] == [
        ("none", "plain"),
        ("random:clover2", "chain-2"),
        ("random:clover2", "small"),
        ("random:clover2", "[[0],[1]]"),
    ]
    assert all(r["identical_to_plain"] == "1/1" for r in doc["results"])
    assert set(doc["per_prompt"]) == {
        "torch/none/plain",
        "torch/random:clover2/chain-2",
        "torch/random:clover2/small",
        "torch/random:clover2/[[0],[1]]",
    }
    # a dynamic tree beside a chain: the heads run on both, prompt lookup (capped by chains only) on the chain
    rc = bench_main(
        [
            "--base",
            str(base),
            "--heads",
            "random:clover2,lookup",
            "--tree",
            "chain-2,dynamic-4",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert [(r["heads"], r["tree"]) for r in json.loads(out.read_text())["results"]] == [
        ("none", "plain"),
        ("random:clover2", "chain-2"),
        ("random:clover2", "dynamic-4"),
        ("lookup", "chain-2"),
    ]


def test_plain_only_backend(base, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w20 w30"}) + "\n")
    out = tmp_path / "bench.json"
    rc = bench_main(
        [
            "--base",
            str(base),
            "--heads",
            "random:clover2",
            "--backend",
            "torch:plain",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "6",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert [(r["backend"], r["heads"]) for r in json.loads(out.read_text())["results"]] == [("torch", "none")]


def test_mtbench_prompts_are_the_80_first_turns():
    prompts = load_prompts("mtbench", None)
    assert len(prompts) == 80 and prompts[0].startswith("Compose an engaging travel blog post")
    five = load_prompts("mtbench", 5)
    assert len(five) == 5 and five[0] == prompts[0] and five[1] == prompts[16]  # spread over the categories


def test_bench_errors(base, tmp_path, capsys):
    assert bench_main(["--base", str(base), "--heads", "random:medusa", "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    assert bench_main(["--base", str(base), "--prompts", str(bad)]) == 2
    assert "no 'prompt' string" in capsys.readouterr().err
    assert bench_main(["--base", str(base), "--heads", "nope-heads", "--prompts", "mtbench", "--num-prompts", "1"]) == 2
    assert "not found" in capsys.readouterr().err


def test_concurrency_table_json_and_plot(tmp_path_factory, tmp_path, capsys):
    """clover-bench --concurrency: every (concurrency, mode) row, identity with solo plain decoding, the plot."""
    from ort_helpers import tiny_artifact

    art = tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{10 + i} w{20 + i} w30 w{40 + i}"}) for i in range(6)) + "\n")
    out = tmp_path / "c.json"
    rc = bench_main(
        [
            "--artifact",
            str(art),
            "--backend",
            "ort",
            "--concurrency",
            "1,3",
            "--tree",
            "chain-2",
            "--control",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    assert "ttft p50" in table and "itl p95" in table and "auto" in table
    doc = json.loads(out.read_text())
    rows = [(r["concurrency"], r["mode"]) for r in doc["results"]]
    assert rows == [(c, m) for c in (1, 3) for m in ("plain", "plain-2", "chain-2", "auto")]  # plain-2: --control (A/A)
    for r in doc["results"]:
        assert r["identical_to_solo_plain"] == "6/6" and r["tokens_per_second"] > 0
        assert r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0 and r["itl_p95_ms"] >= r["itl_p50_ms"] >= 0
    assert doc["results"][2]["acceptance_length"] > 1.0  # chain-2 accepted some drafts
    assert doc["results"][1]["acceptance_length"] == 1.0 and "A/A" in doc["control"]
    assert out.with_suffix(".png").stat().st_size > 1000


def test_concurrency_bad_levels_exit_nonzero(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10"}) + "\n")
    rc = bench_main(["--backend", "ort", "--concurrency", "1,x", "--prompts", str(prompts), "--no-chat"])
    assert rc != 0 and "--concurrency" in capsys.readouterr().err


def test_held_out_accuracy_beside_live_acceptance(base, tmp_path, capsys):
    """Heads with a training record: the bench shows clover-train's held-out accuracy per depth next to the live
    acceptance per depth, and records both in the JSON."""
    from clover.models.head_io import random_heads, save_heads
    from clover.models.loading import load_base

    heads = tmp_path / "heads"
    save_heads(random_heads(load_base(str(base)), "clover2"), heads)
    epoch = {
        "epoch": 3,
        "val_top1": [0.5, 0.4, 0.3],
        "val_topk": [0.7, 0.6, 0.5],
        "val_chain_accept": 1.9,
        "val_top1_early": [0.4, 0.3, 0.2],
        "early_answer_tokens": 128,
    }
    (heads / "training.json").write_text(json.dumps({"epochs": [epoch]}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w20 w30"}) + "\n")
    out = tmp_path / "bench.json"
    rc = bench_main(
        [
            "--base",
            str(base),
            "--heads",
            str(heads),
            "--tree",
            "chain-2",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "top-1 0.50 0.40 0.30; top-3 0.70 0.60 0.50; top-1 over the first 128 answer tokens 0.40 0.30 0.20" in table
    assert "held-out chain estimate 1.70" in table  # 1 + 0.5 + 0.5 * 0.4: the chain-2 this run drafted
    doc = json.loads(out.read_text())
    held = doc["held_out"][str(heads)]
    assert held["top1"] == epoch["val_top1"] and held["top3"] == epoch["val_topk"] and held["epoch"] == 3
    replayed = doc["replay"][str(heads)]["torch"]  # along the plain output: 8 tokens, 7 roots with a next token
    assert replayed["positions"][0] == 7 and "replay on torch: top-1" in table
    assert sum(round(b["share"] * 7) for b in replayed["top1_by_base_probability"]) == 7
    assert "depth 1 by the base's probability of the token: p 0.0-0.5: top-1" in table


def test_replay_counts_what_a_chain_would_accept(base):
    """The replay's depth-d accuracy is what a token-by-token chain drafts: with the same heads, the share of
    positions whose first d drafts are right bounds the live chain's acceptance, and its depth-1 top-1 is exactly
    the drafts a chain-1 run accepts when it drafts after every token (verified here by stepping chain-1 by hand)."""
    import numpy as np

    from clover.runtime.generator import Generator
    from clover.runtime.proposers import draft_tree
    from clover.runtime.sampling import SamplingParams
    from clover.runtime.tree import resolve_tree
    from clover.tools.bench_replay import ReplayCounts, replay

    plain = Generator.load(str(base), "none", "torch")
    heads = Generator.load(str(base), "random:clover2", "torch", "chain-1")
    prompt = plain.encode_prompt("w10 w20 w30 w10 w20")
    ids = plain.generate(prompt, GenerationParams(max_new_tokens=16, ignore_eos=True)).token_ids
    counts = ReplayCounts(3)
    replay(heads.runner, prompt, ids, 3, counts)
    assert counts.positions == [15, 14, 13]
    assert counts.top1[0] <= counts.topk[0] and counts.chain[0] == counts.top1[0] and counts.chain[2] <= counts.chain[1]
    # by hand: after each token, draft chain-1 from the runner and compare with the next plain token
    r, right = heads.runner, 0
    bins, bins_right = [0, 0, 0], [0, 0, 0]  # depth 1 by the base's probability of the token: < 0.5, 0.5-0.9, >= 0.9
    r.reset(len(prompt) + len(ids) + 1)
    r.forward(np.array(prompt), np.arange(len(prompt)), np.tri(len(prompt), dtype=bool))
    r.commit(np.arange(len(prompt)), np.append(prompt[1:], ids[0]))
    for i in range(len(ids) - 1):
        draft = draft_tree(r, resolve_tree("chain-1"), ids[i], SamplingParams(), np.random.default_rng(0))
        hit = int(draft.tokens[1] == ids[i + 1])
        right += hit
        logits = r.forward(np.array(ids[i : i + 1]), np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool))[-1]
        p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        b = 0 if p[ids[i + 1]] < 0.5 else 1 if p[ids[i + 1]] < 0.9 else 2
        bins[b], bins_right[b] = bins[b] + 1, bins_right[b] + hit
        r.commit(np.zeros(1, dtype=np.int64), np.array(ids[i + 1 : i + 2]))
    assert right == counts.top1[0]
    assert counts.by_confidence == bins and counts.top1_by_confidence == bins_right
    summary = counts.summary()["top1_by_base_probability"]
    assert [b["p"] for b in summary] == [[0.0, 0.5], [0.5, 0.9], [0.9, 1.0]]
    assert sum(b["share"] for b in summary) == pytest.approx(1.0, abs=1e-3)
    assert all(
        b["top1"] is None if n == 0 else b["top1"] == round(k / n, 4) for b, n, k in zip(summary, bins, bins_right)
    )


def test_several_artifacts_side_by_side(tmp_path_factory, tmp_path, capsys):
    """--artifact A,B: each artifact's heads in one interleaved run; B's base graph is A's byte for byte (B adds a
    draft vocabulary), so B's heads are checked against A's plain run and B gets none of its own."""
    from ort_helpers import tiny_artifact

    root = tmp_path_factory.getbasetemp()
    a, b = tiny_artifact(root, "clover2"), tiny_artifact(root, "clover2", draft_vocab=64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w10 w20 w30"}) + "\n")
    out = tmp_path / "bench.json"
    rc = bench_main(
        [
            "--artifact",
            f"{a},{b}",
            "--backend",
            "ort",
            "--tree",
            "chain-2",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "10",
            "--no-chat",
            "--json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rows = [(r["backend"], r["heads"]) for r in json.loads(out.read_text())["results"]]
    assert rows == [
        (f"ort@{a.name}", "none"),
        (f"ort@{a.name}", "random:clover2:0"),
        (f"ort@{b.name}", "random:clover2:0"),
    ]
    doc = json.loads(out.read_text())
    assert all(r["identical_to_plain"] == "1/1" for r in doc["results"])
    printed = capsys.readouterr().out
    assert f"ort@{b.name}" in printed
    # plain decoding's memory-bandwidth limit beside its speed: the plain run's artifact, its weight files' bytes
    from clover.artifact import base_weight_files, read_manifest

    limits = doc["bandwidth_limit"]
    assert limits["read_gbps"] > 0 and list(limits["plain"]) == [f"ort@{a.name}"]
    x = limits["plain"][f"ort@{a.name}"]
    assert (
        0 < x["weight_bytes"] < sum(f.stat().st_size for f in base_weight_files(a, read_manifest(a)))
    )  # one embedding row
    assert x["limit_tokens_per_second"] == pytest.approx(
        limits["read_gbps"] * 1e9 / x["weight_bytes"], rel=1e-2, abs=0.1
    )
    assert f"ort@{a.name}: " in printed and "memory-bandwidth limit" in printed
    assert bench_main(["--artifact", f"{a},{b}", "--backend", "ort", "--concurrency", "1"]) == 2
    assert "--concurrency runs one artifact" in capsys.readouterr().err
