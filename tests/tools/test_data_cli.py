"""clover-data grow / info end to end on a tiny exported artifact: growth in bounded runs that resume, answers
equal to plain greedy decoding of the same artifact, stopping on a signal, damaged files, and clover-train on
the corpus."""

import json
import os
import shutil
import signal

import numpy as np
import pytest
from helpers import tiny_hf_folder

# Imported at collection, so Engine's default log= binds the session's stderr, not one test's capsys stream.
import clover.runtime.engine  # noqa: F401
from clover.runtime.backends.ort import load_runner
from clover.runtime.generator import Generator
from clover.runtime.params import GenerationParams
from clover.runtime.sampling import SamplingParams
from clover.runtime.tokenizer import Tokenizer
from clover.tools import data as data_tool
from clover.tools.data import main as data_main
from clover.tools.export import main as export_main
from clover.tools.train import main as train_main
from clover.train.corpus import Corpus
from clover.train.data import first_turn_prompt, load_conversations, prompt_order, turn_prompt

pytest.importorskip("transformers")
MAX_NEW = 12


def varied_hf_folder(path):
    """tiny_hf_folder with larger weights: varied greedy answers (not one repeated token), some ending at EOS."""
    import torch
    import transformers

    tiny_hf_folder(path)
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1.0 if "embed" in name else 0.2)
        model.model.embed_tokens.weight[1] *= 2.5  # EOS (w1) a little likelier: some answers stop early
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    base = varied_hf_folder(root / "base")
    artifact = root / "artifact"
    assert export_main(["--base", str(base), "--out", str(artifact), "--attention", "fused", "--no-verify"]) == 0
    rng = np.random.default_rng(0)
    prompts = root / "chats.jsonl"
    with prompts.open("w") as f:
        for i in range(60):
            user = " ".join(f"w{x}" for x in rng.integers(6, 96, size=rng.integers(2, 9)))
            chat = [{"role": "user", "content": user}, {"role": "assistant", "content": "w10"}]
            if i % 3 == 0:  # a second exchange: its user turn is a prompt of clover-data grow --turns 2
                chat += [
                    {"role": "user", "content": " ".join(f"w{x}" for x in rng.integers(6, 96, size=3))},
                    {"role": "assistant", "content": "w11"},
                ]
            f.write(json.dumps({"messages": chat}) + "\n")
    return root, base, artifact, prompts


def grow(setup, out, *extra):
    root, _, artifact, prompts = setup
    return data_main(
        [
            "grow",
            "--artifact",
            str(artifact),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            str(MAX_NEW),
            "--max-batch",
            "4",
            "--threads",
            "1",
            "--shard-tokens",
            "60",
            *map(str, extra),
        ]
    )


def test_grow_resumes_and_stores_plain_greedy_answers(setup, capsys):
    root, _, artifact, prompts = setup
    out = root / "corpus"
    assert grow(setup, out, "--target-tokens", 100) == 0
    err = capsys.readouterr().err
    assert "tokens/s" in err and "MiB per million tokens" in err
    first = Corpus.open(out).provenance
    assert first.totals["response_tokens"] >= 100 and len(first.shards) >= 2
    assert grow(setup, out, "--target-tokens", 250) == 0  # a second run continues after the first
    capsys.readouterr()
    corpus = Corpus.open(out)
    prov = corpus.provenance
    convs = list(corpus.conversations())
    indices = [c.index for c in convs]
    order = [i for i, _ in prompt_order(60, 0, 0.02)]
    assert len(set(indices)) == len(indices)  # no prompt answered twice
    assert indices == order[: prov.next_position]  # in clover-train's order, none skipped
    assert prov.shards[: len(first.shards)] == first.shards  # the first run's shards are kept as they were
    assert [r.response_tokens for r in prov.runs] == [
        first.totals["response_tokens"],
        prov.totals["response_tokens"] - first.totals["response_tokens"],
    ]
    assert sum(r.conversations for r in prov.runs) == prov.totals["conversations"] == len(convs)
    assert all(r.stopped == "target" and r.tokens_per_second > 0 and r.heads == "none" for r in prov.runs)
    assert prov.generator.max_new_tokens == MAX_NEW and prov.prompts.source == "file:chats.jsonl"
    # the answers are the artifact's plain greedy decoding of each first user turn
    tok = Tokenizer.from_dir(artifact / "tokenizer")
    plain = Generator(load_runner(artifact, heads="none"), tok)
    chats = load_conversations(str(prompts))
    assert {c.finish_reason for c in convs} == {"stop", "length"}
    assert len({t for c in convs for t in c.response.tolist()}) > 20
    for c in convs:
        assert c.prompt.tolist() == first_turn_prompt(tok, chats[c.index])
        want = plain.generate(c.prompt.tolist(), GenerationParams(max_new_tokens=MAX_NEW))
        assert c.response.tolist() == want.token_ids and c.finish_reason == want.finish_reason, c.index
    # info reads it all back; another generator setting is refused
    assert data_main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert f"{prov.totals['response_tokens']} response tokens" in info and "checksums ok" in info
    assert info.count("tokens/s") == 2 and "file:chats.jsonl" in info
    assert (
        data_main(
            [
                "grow",
                "--artifact",
                str(artifact),
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--max-new-tokens",
                "20",
            ]
        )
        == 2
    )
    assert "grown with other generator: max_new_tokens 12 there, 20 now" in capsys.readouterr().err
    # a damaged shard: one line naming the file and the fix
    broken = root / "broken"
    shutil.copytree(out, broken)
    shard = broken / prov.shards[-1].file
    shard.write_bytes(shard.read_bytes()[:-7])
    assert data_main(["info", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"clover-data: error: corpus shard {shard} is damaged") and "git checkout --" in err
    assert len(err.splitlines()) == 1


def test_grow_answers_a_file_of_prompts(setup, capsys):
    """A prompt file (lone user turns, or clover-bench's {"prompt": ...} lines) is a prompt source too."""
    root, _, artifact, _ = setup
    prompts = root / "prompts.jsonl"
    lines = [
        {"prompt": "w5 w9 w12"},
        {"messages": [{"role": "user", "content": "w7 w8"}]},
        {"prompt": "w20 w21"},
        {"conversations": [{"from": "human", "value": "w30"}]},
    ]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = root / "from-prompts"
    assert (
        data_main(
            [
                "grow",
                "--artifact",
                str(artifact),
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--max-new-tokens",
                str(MAX_NEW),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    convs = list(Corpus.open(out).conversations())
    tok = Tokenizer.from_dir(artifact / "tokenizer")
    chats = load_conversations(str(prompts), prompts=True)
    assert len(chats) == 4 and sorted(c.index for c in convs) == [0, 1, 2, 3]
    for c in convs:
        assert c.prompt.tolist() == tok.encode_chat(chats[c.index], add_generation_prompt=True) and len(c.response) > 0


def test_self_prompts_write_a_prompt_file_that_grow_answers(setup, capsys, monkeypatch):
    """benchmarks/self_prompts.py: the base writes the user turns itself (seeded: a rerun writes the same file)."""
    import importlib.util
    import sys
    from pathlib import Path

    root, _, artifact, _ = setup
    spec = importlib.util.spec_from_file_location(
        "self_prompts", Path(__file__).resolve().parents[2] / "benchmarks" / "self_prompts.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tok = Tokenizer.from_dir(artifact / "tokenizer")
    assert tok.decode(mod.user_header(tok), skip_special_tokens=False) == "w3"  # the tiny template: w3 TEXT w4
    files = []
    for run in range(2):
        files.append(root / f"self-{run}.jsonl")
        monkeypatch.setattr(
            sys,
            "argv",
            [
                "self_prompts",
                "--artifact",
                str(artifact),
                "--count",
                "24",
                "--out",
                str(files[-1]),
                "--max-new-tokens",
                "24",
                "--threads",
                "1",
            ],
        )
        assert mod.main() == 0
    assert "prompts" in capsys.readouterr().err
    assert files[0].read_text() == files[1].read_text()
    chats = load_conversations(str(files[0]), prompts=True)
    assert 0 < len(chats) <= 24 and len({c[0]["content"] for c in chats}) == len(chats)
    assert (
        data_main(
            [
                "grow",
                "--artifact",
                str(artifact),
                "--prompts",
                str(files[0]),
                "--out",
                str(root / "self"),
                "--max-new-tokens",
                str(MAX_NEW),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert Corpus.open(root / "self").provenance.totals["conversations"] == len(chats)


def test_later_turns_continue_a_corpus_whose_first_turns_are_answered(setup, capsys):
    root, _, artifact, prompts = setup
    out = root / "turns"
    assert grow(setup, out) == 0  # the default target (5M tokens) is far: every first turn
    assert grow(setup, out) == 0
    assert "every prompt is answered (--turns 2 answers the next user turns, --passes 2" in capsys.readouterr().err
    first = Corpus.open(out).provenance
    assert first.prompts.turns == 1 and first.next_position == 60
    assert grow(setup, out, "--turns", 2) == 0
    corpus = Corpus.open(out)
    prov = corpus.provenance
    convs = list(corpus.conversations())
    chats = load_conversations(str(prompts))
    order = [i for i, _ in prompt_order(60, 0, 0.02)]
    two = [i for i in order if sum(m["role"] == "assistant" for m in chats[i]) >= 2]
    assert len(two) == 20 and prov.prompts.turns == 2 and prov.next_position == 120
    assert [(c.index, c.turn) for c in convs] == [(i, 1) for i in order] + [(i, 2) for i in two]
    assert prov.skipped - first.skipped == 40  # conversations without a second exchange
    # a second turn's prompt is the conversation before its second answer; the answer is plain greedy decoding
    tok = Tokenizer.from_dir(artifact / "tokenizer")
    plain = Generator(load_runner(artifact, heads="none"), tok)
    for c in convs[60:]:
        assert c.prompt.tolist() == turn_prompt(tok, chats[c.index], 2)
        assert len(c.prompt) > len(first_turn_prompt(tok, chats[c.index])) + 3  # with the first exchange before it
        assert (
            c.response.tolist() == plain.generate(c.prompt.tolist(), GenerationParams(max_new_tokens=MAX_NEW)).token_ids
        )
    capsys.readouterr()
    assert grow(setup, out, "--turns", 1) == 2
    assert "answers 2 turns per conversation; --turns 1 would shorten its prompt order" in capsys.readouterr().err
    assert grow(setup, out) == 0  # the corpus's turns by default
    assert "every prompt is answered (--turns 3" in capsys.readouterr().err
    assert data_main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "2 turn(s) of 60 conversations, 120/120 in order done" in info and "answers by turn: 1: 60, 2: 20" in info


def test_a_second_pass_samples_another_answer_to_every_prompt(setup, capsys):
    root, _, artifact, prompts = setup
    out = root / "passes"
    assert grow(setup, out) == 0  # every first turn, greedy
    assert grow(setup, out) == 0
    assert "--passes 2 samples a second answer to each" in capsys.readouterr().err
    assert grow(setup, out, "--passes", 2, "--target-tokens", 850) == 0  # bounded: part of the second pass
    corpus = Corpus.open(out)
    prov = corpus.provenance
    convs = list(corpus.conversations())
    order = [i for i, _ in prompt_order(60, 0, 0.02)]
    assert prov.prompts.passes == 2 and 60 < prov.next_position < 120
    assert [(c.index, c.sample) for c in convs] == [(i, 1) for i in order] + [(i, 2) for i in order[: len(convs) - 60]]
    assert prov.generator.resampling.startswith("passes 2..: temperature 0.7, top_p 0.95")
    # a sampled answer: the artifact's plain decoding sampled with the prompt's position as seed (reruns repeat it)
    tok = Tokenizer.from_dir(artifact / "tokenizer")
    plain = Generator(load_runner(artifact, heads="none"), tok)
    second = convs[60:]
    assert sum(c.response.tolist() != g.response.tolist() for c, g in zip(second, convs)) >= len(second) // 2
    for position, c in enumerate(second, 60):
        want = plain.generate(
            c.prompt.tolist(),
            GenerationParams(max_new_tokens=MAX_NEW, sampling=SamplingParams(0.7, 0.95, seed=position)),
        )
        assert c.prompt.tolist() == convs[position - 60].prompt.tolist() and c.response.tolist() == want.token_ids
    capsys.readouterr()
    # the settings stay: fewer passes, other turns or another temperature are refused with one line each
    for extra, message in (
        (("--passes", 1), "--passes 1 would shorten its prompt order"),
        (("--turns", 2), "--turns 2 would reorder its later passes"),
        (("--temperature", 1.0), "resampling 'passes 2..: temperature 0.7"),
    ):
        assert grow(setup, out, *extra) == 2
        assert message in capsys.readouterr().err
    assert grow(setup, out, "--temperature", 0) == 2
    assert "--temperature must be positive" in capsys.readouterr().err
    assert grow(setup, out) == 0  # the corpus's passes by default: the rest of the second pass
    assert Corpus.open(out).provenance.next_position == 120
    capsys.readouterr()
    assert data_main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "1 turn(s) of 60 conversations in 2 passes, 120/120 in order done" in info
    assert "answers by sample: 1: 60, 2: 60" in info and "; passes 2..: temperature 0.7" in info


def test_sigterm_keeps_the_finished_answers(setup, capsys, monkeypatch):
    root = setup[0]
    out = root / "stopped"
    real = data_tool.grow

    def grow_then_signal(corpus, engine, order, prompt_ids, max_new, limits, stop, on_answer, *rest):
        count = [0]

        def answered(tokens):
            on_answer(tokens)
            count[0] += 1
            if count[0] == 7:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler sets `stop`: the loop drops what is under way

        return real(corpus, engine, order, prompt_ids, max_new, limits, stop, answered, *rest)

    monkeypatch.setattr(data_tool, "grow", grow_then_signal)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert grow(setup, out, "--target-tokens", 10_000) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before  # handlers restored
    err = capsys.readouterr().err
    assert "SIGTERM: writing the finished answers" in err and "(signal)" in err
    corpus = Corpus.open(out)
    prov = corpus.provenance
    convs = list(corpus.conversations())
    # answers collected in the same wait() as the 7th are kept too; at most 2 x max_batch are under way
    assert (
        1 <= len(convs) <= 7 + 8 and [c.index for c in convs] == [i for i, _ in prompt_order(60, 0, 0.02)][: len(convs)]
    )
    assert prov.runs[-1].stopped == "signal" and prov.runs[-1].conversations == len(convs) == prov.next_position
    monkeypatch.setattr(data_tool, "grow", real)
    assert grow(setup, out, "--target-tokens", 60) == 0  # the next run continues after them
    assert [c.index for c in Corpus.open(out).conversations()][: len(convs)] == [c.index for c in convs]


def test_clover_train_on_the_corpus(setup, capsys):
    root, base, _, _ = setup
    out = root / "train-corpus"
    assert grow(setup, out, "--target-tokens", 300) == 0
    corpus = Corpus.open(out)
    heads = root / "heads"
    code = train_main(
        [
            "--base",
            str(base),
            "--data",
            str(out),
            "--out",
            str(heads),
            "--cache-dir",
            str(root / "features"),
            "--max-tokens",
            "150",
            "--max-length",
            "40",
            "--batch-tokens",
            "256",
            "--topk",
            "8",
            "--arch",
            "clover2",
            "--num-heads",
            "2",
            "--epochs",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err
    assert "feature building:" in err and "tokens/s" in err and "training:" in err
    prov = json.loads((heads / "training.json").read_text())
    data = prov["data"]
    assert data["responses"] == "corpus" and data["corpus"]["path"] == str(out)
    assert data["corpus"]["corpus_response_tokens"] == corpus.provenance.totals["response_tokens"]
    assert 150 <= data["corpus"]["used_response_tokens"] <= corpus.provenance.totals["response_tokens"]
    assert data["feature_build"]["tokens_per_second"] > 0 and prov["training_loss_tokens_per_second"] > 0
    assert len(prov["epochs"]) == 1
    # validation conversations are the corpus split's, by prompt index: held out whatever --seed says
    from clover.train.features import FeatureCache

    cache = FeatureCache(next(p for p in (root / "features").iterdir() if (p / "meta.json").is_file()))
    held = corpus.validation_indices()
    by_prompt = {tuple(c.prompt.tolist()): c.index for c in corpus.conversations()}
    for i in range(cache.meta["num_sequences"]):
        ids = cache.arrays["tokens"][cache.offsets[i] : cache.offsets[i + 1]].tolist()
        index = next(v for p, v in by_prompt.items() if ids[: len(p)] == list(p))
        assert bool(cache.validation[i]) == (index in held)
    assert any(cache.validation) and not all(cache.validation)
    # a corpus with --responses dataset is refused
    assert (
        train_main(["--base", str(base), "--data", str(out), "--out", str(root / "h2"), "--responses", "dataset"]) == 2
    )
    assert "corpus of the base's own answers" in capsys.readouterr().err
    # --skip-tokens: go on from those heads with the answers after the first 150 tokens; the validation split stays
    more = [
        "--base",
        str(base),
        "--data",
        str(out),
        "--cache-dir",
        str(root / "features"),
        "--max-tokens",
        "100",
        "--max-length",
        "40",
        "--batch-tokens",
        "256",
        "--topk",
        "8",
        "--epochs",
        "1",
        "--init",
        str(heads),
    ]
    assert train_main([*more, "--out", str(root / "heads-2"), "--skip-tokens", "150"]) == 0, capsys.readouterr().err
    later = json.loads((root / "heads-2" / "training.json").read_text())["data"]["corpus"]
    assert later["skipped_response_tokens"] == 150 and later["shards_used"] >= data["corpus"]["shards_used"]
    capsys.readouterr()
    held = corpus.provenance.totals["response_tokens"]
    assert train_main([*more, "--out", str(root / "heads-3"), "--skip-tokens", str(held)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--skip-tokens {held}: give 0 up to the corpus's answer tokens ({held})" in err[0]
    assert not (root / "heads-3").exists()
