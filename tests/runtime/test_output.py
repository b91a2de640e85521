"""clover.runtime.output: exact stopping and streaming, against a decode-every-prefix reference."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import TOKENIZER_CORPUS

from clover.errors import CloverError
from clover.runtime.output import OutputTracker, StopConditions
from clover.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tok(smollm2_path: Path) -> Tokenizer:
    """SmolLM2's tokenizer (saved by transformers next to the converted embedded default)."""
    return Tokenizer.from_dir(smollm2_path)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tiny SentencePiece-style (Llama-2 layout) tokenizer: "▁" word starts, byte fallback, Strip decoder.

    Its tokens decode differently alone than in context (a leading "▁" is stripped at the start of a
    text), which is what the prefix-offset window of the streaming detokenizer is for.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    corpus = TOKENIZER_CORPUS
    backend.train_from_iterator(corpus, trainer=trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces are ordinary vocabulary entries, as in Llama 2
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    backend = HFTokenizer.from_str(json.dumps(spec))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    folder = tmp_path_factory.mktemp("sp-tokenizer")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(folder)


REAL_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 3:45 pm, and the answer is 42!",
    "日本語のテキストと中文文本，한국어 텍스트。Ünïcödé façade — “quotes”.",
    "emoji 🎉🚀👍🏽 👨‍👩‍👧‍👦 family 🫠 and a rare one 𓀀 too",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # 注释 ✓\n\n\tend  ",
]


def stream(tracker: OutputTracker, ids: Sequence[int], rng: random.Random, max_chunk: int = 5) -> list[str]:
    """Feed `ids` in random chunks (as speculative steps would); return the deltas, flush included."""
    deltas = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        deltas.append(tracker.add(ids[i : i + n]))
        i += n
    deltas.append(tracker.flush())
    return deltas


def reference_stop(tok: Tokenizer, ids: Sequence[int], stop: StopConditions) -> tuple[list[int], str, str | None]:
    """Plain one-token-at-a-time stopping: decode every prefix from scratch (O(n^2), obviously right)."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if ids[n - 1] in stop.eos_token_ids:
            return list(ids[:n]), tok.decode(ids[: n - 1]), "stop"
        hits = [i for s in stop.stop_strings if (i := text.find(s)) >= 0]
        if hits:
            return list(ids[:n]), text[: min(hits)], "stop"
        if n == stop.max_new_tokens:
            return list(ids[:n]), text, "length"
    return list(ids), tok.decode(ids), None


def check_against_reference(tok: Tokenizer, ids: list[int], stop: StopConditions, seed: int) -> OutputTracker:
    rng = random.Random(seed)
    tracker = OutputTracker(tok, stop)
    deltas = stream(tracker, ids, rng)
    expected_ids, expected_text, expected_reason = reference_stop(tok, ids, stop)
    assert tracker.token_ids == expected_ids
    assert tracker.num_tokens == len(expected_ids)
    assert tracker.text == expected_text
    assert tracker.finish_reason == expected_reason
    assert "".join(deltas) == tracker.text
    for s in stop.stop_strings:
        assert all(s not in d for d in deltas)
    return tracker


# ----------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("text", REAL_TEXTS)
def test_deltas_concatenate_to_text(tok: Tokenizer, text: str, seed: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=10_000))
    deltas = stream(tracker, ids, random.Random(seed))
    assert "".join(deltas) == tracker.text == text
    assert not tracker.finished and tracker.token_ids == ids
    assert all("\ufffd" not in d for d in deltas)  # never half a character


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    """The texts above do exercise the hold-back of incomplete UTF-8 characters."""
    ids = tok.encode(REAL_TEXTS[2], add_special_tokens=False)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=10_000))
    deltas = [tracker.add([i]) for i in ids]
    assert "" in deltas  # some tokens had to wait for the next one
    assert "".join(deltas) + tracker.flush() == REAL_TEXTS[2]


@pytest.mark.parametrize("seed", range(5))
def test_random_token_ids_match_full_decode(tok: Tokenizer, seed: int) -> None:
    """Arbitrary (even invalid UTF-8) byte-level tokens: streamed text == decode of all tokens."""
    rng = random.Random(seed)
    special = set(tok.backend.get_added_tokens_decoder())
    ids = [i for i in (rng.randrange(tok.vocab_size) for _ in range(300)) if i not in special]
    ids[50:50] = [tok.encode("🎉")[0]] * 3  # lead bytes of a 4-byte character that never completes
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=10_000))
    deltas = stream(tracker, ids, rng)
    assert "".join(deltas) == tracker.text == tok.decode(ids)


SP_TEXTS = ["the fox 世界 🎉 jumps  over   the lazy dog ", "tokens  per step 😀 clover heads"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("text", SP_TEXTS)
def test_sentencepiece_style_deltas(sp_tok: Tokenizer, text: str, seed: int) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert sp_tok.decode(ids[1:2]) != sp_tok.decode(ids[:2])[len(sp_tok.decode(ids[:1])) :]  # context matters
    tracker = OutputTracker(sp_tok, StopConditions(max_new_tokens=10_000))
    deltas = stream(tracker, ids, random.Random(seed))
    assert "".join(deltas) == tracker.text == sp_tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stop_strings", [("x 世",), ("  over",), ("🎉 j",), ("dog ",)])
def test_sentencepiece_style_stop_strings(sp_tok: Tokenizer, stop_strings: tuple[str, ...]) -> None:
    ids = sp_tok.encode(SP_TEXTS[0], add_special_tokens=False)
    for seed in range(3):
        check_against_reference(sp_tok, ids, StopConditions(1000, stop_strings=stop_strings), seed)


def test_length_finish_mid_character_flushes_it(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=len(ids) - 1))
    deltas = [tracker.add(ids), tracker.flush()]
    assert tracker.finish_reason == "length"
    assert "".join(deltas) == tracker.text == tok.decode(ids[:-1])


# ------------------------------------------------------------------------------------------ stopping


def test_eos_inside_a_step(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    head, tail = tok.encode("Hello world", add_special_tokens=False), tok.encode(" more", add_special_tokens=False)
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=100, eos_token_ids=tok.eos_token_ids))
    delta = tracker.add(head + [eos] + tail)
    assert tracker.finished and tracker.finish_reason == "stop"
    assert tracker.token_ids == head + [eos]
    assert tracker.text == delta == "Hello world"
    assert tracker.add(tail) == "" and tracker.num_tokens == len(head) + 1
    assert tracker.flush() == ""


def test_stop_string_spanning_two_tokens(tok: Tokenizer) -> None:
    text = "The answer is 42. Thanks for asking!"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # a stop string made of the end of one token and the start of the next
    k = next(k for k in range(len(ids) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop_string = pieces[k][-2:] + pieces[k + 1][:2]
    tracker = check_against_reference(tok, ids, StopConditions(100, stop_strings=(stop_string,)), seed=0)
    assert tracker.token_ids == ids[: k + 2]
    assert tracker.text == text[: text.index(stop_string)]


def test_stop_string_inside_one_token(tok: Tokenizer) -> None:
    text = "We are verifying everything now"
    ids = tok.encode(text, add_special_tokens=False)
    k = next(k for k, i in enumerate(ids) if len(tok.decode([i])) >= 6)
    piece = tok.decode([ids[k]])
    stop_string = piece[2:4]  # strictly inside the token's text
    tracker = OutputTracker(tok, StopConditions(100, stop_strings=(stop_string,)))
    deltas = [tracker.add(ids), tracker.flush()]
    assert tracker.token_ids == ids[: k + 1]
    assert tracker.text == text[: text.index(stop_string)] == "".join(deltas)
    assert tracker.finish_reason == "stop"


def test_two_stop_strings_inside_one_token(tok: Tokenizer) -> None:
    """The text ends before the first occurrence, whichever stop string is listed first."""
    text = "We are verifying everything now"
    ids = tok.encode(text, add_special_tokens=False)
    k = next(k for k, i in enumerate(ids) if len(tok.decode([i])) >= 6)
    piece = tok.decode([ids[k]])
    tracker = check_against_reference(tok, ids, StopConditions(100, stop_strings=(piece[3:5], piece[1:3])), 0)
    assert tracker.token_ids == ids[: k + 1]
    assert tracker.text == text[: text.index(piece[1:3])]


def test_special_tokens_are_written_out_unless_skipped(tok: Tokenizer) -> None:
    """skip_special_tokens (True by default) leaves a special token's text out; False writes it, streamed alike."""
    ids = tok.encode("Hi there", add_special_tokens=False)
    start = tok.token_to_id("<|im_start|>")
    text = {}
    for skip in (True, False):
        tracker = OutputTracker(tok, StopConditions(100), skip_special_tokens=skip)
        deltas = [tracker.add([i]) for i in [start, *ids]] + [tracker.flush()]
        assert "".join(deltas) == tracker.text
        text[skip] = tracker.text
    assert text[True] == "Hi there" and text[False] == "<|im_start|>Hi there"


def test_include_stop_str_ends_the_text_after_the_stop_string(tok: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output: the same tokens and the same stop, the text cut after the stop string (the
    first to start, as without it), streamed the same."""
    text = "The answer is 42. Thanks for asking!"
    ids = tok.encode(text, add_special_tokens=False)
    for stops in (("42",), ("asking", "answer"), ("ks f",)):
        plain = OutputTracker(tok, StopConditions(100, stop_strings=stops))
        plain.add(ids)
        tracker = OutputTracker(tok, StopConditions(100, stop_strings=stops, include_stop_str=True))
        deltas = [tracker.add([i]) for i in ids] + [tracker.flush()]
        first = min((text.index(s), s) for s in stops if s in text)
        assert tracker.token_ids == plain.token_ids and tracker.finish_reason == "stop"
        assert tracker.text == "".join(deltas) == text[: first[0] + len(first[1])]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "stop_strings",
    [
        ("42",),
        (". T",),
        ("asking", "answer"),  # the second one listed occurs first
        ("界",),  # a character spread over several tokens
        ("🚀👍",),
        ("The",),  # at the very start
        ("never there",),
        ("\n\n",),
    ],
)
def test_stop_strings_match_reference(tok: Tokenizer, stop_strings: tuple[str, ...], seed: int) -> None:
    text = "The answer is 42. Thanks for asking! 世界 🎉🚀👍🏽\n\nMore text after the break."
    ids = tok.encode(text, add_special_tokens=False)
    check_against_reference(tok, ids, StopConditions(1000, stop_strings=stop_strings), seed)


def test_stop_string_completed_by_a_token_with_a_partial_character(tok: Tokenizer) -> None:
    """Byte-level BPE has tokens like " " + the first bytes of an emoji: the stop string "Hi " is complete
    at that token, although its text still ends in an incomplete character."""
    text = "Say Hi 🎉 now"
    ids = tok.encode(text, add_special_tokens=False)
    k = next(k for k, i in enumerate(ids) if tok.decode([i]) == " \ufffd")
    tracker = check_against_reference(tok, ids, StopConditions(100, stop_strings=("Hi ",)), seed=0)
    assert tracker.token_ids == ids[: k + 1]
    assert tracker.text == "Say "


def test_stop_string_never_streamed(tok: Tokenizer) -> None:
    """A prefix of a stop string is held back, then released once it turns out not to be one."""
    text = "say wor, then wo and w, then world: the end"
    ids = tok.encode(text, add_special_tokens=False)
    tracker = OutputTracker(tok, StopConditions(100, stop_strings=("world",)))
    shown = ""
    for i in ids:
        shown += tracker.add([i])
        assert tracker.text.startswith(shown)  # nothing shown is ever taken back
        assert "wor" not in shown[len("say wor, then") :]  # the hold-back held
        if tracker.finished:
            break
    shown += tracker.flush()
    assert shown == tracker.text == "say wor, then wo and w, then "
    assert "wor," in shown  # the false alarm was released


def test_hold_back_released_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("ends with wor", add_special_tokens=False)
    tracker = OutputTracker(tok, StopConditions(100, stop_strings=("world",)))
    assert tracker.add(ids) == "ends with "  # "wor" may still become "world"
    tracker.finish("length")
    assert tracker.flush() == "wor"
    assert tracker.text == "ends with wor"


def test_max_new_tokens_exact(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four five six seven", add_special_tokens=False)
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=4, eos_token_ids=tok.eos_token_ids))
    deltas = [tracker.add(ids[:3]), tracker.add(ids[3:])]
    assert tracker.token_ids == ids[:4] and tracker.num_tokens == 4
    assert tracker.finish_reason == "length"
    assert "".join(deltas) + tracker.flush() == tracker.text == tok.decode(ids[:4])
    assert tracker.add(ids) == "" and tracker.num_tokens == 4


def test_eos_at_the_token_limit_is_stop(tok: Tokenizer) -> None:
    ids = tok.encode("one two", add_special_tokens=False) + [tok.eos_token_ids[0]]
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=len(ids), eos_token_ids=tok.eos_token_ids))
    tracker.add(ids)
    assert tracker.finish_reason == "stop" and tracker.text == "one two"


def test_finish_by_caller(tok: Tokenizer) -> None:
    ids = tok.encode("context is full", add_special_tokens=False)
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=100))
    delta = tracker.add(ids)
    tracker.finish("length")
    assert tracker.finished and tracker.finish_reason == "length"
    assert tracker.add(ids) == "" and tracker.token_ids == ids
    tracker.finish("stop")  # already finished: no-op
    assert tracker.finish_reason == "length"
    assert delta + tracker.flush() == tracker.text == "context is full"
    with pytest.raises(CloverError):
        tracker.finish("")


def test_add_after_flush_without_finish(tok: Tokenizer) -> None:
    tracker = OutputTracker(tok, StopConditions(max_new_tokens=100))
    tracker.add(tok.encode("abc", add_special_tokens=False))
    tracker.flush()
    with pytest.raises(CloverError, match="after flush"):
        tracker.add([1])


# -------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, ">= 1"),
        ({"max_new_tokens": -3}, ">= 1"),
        ({"max_new_tokens": 2.0}, "int"),
        ({"max_new_tokens": True}, "int"),
        ({"max_new_tokens": 5, "stop_strings": ("ok", "")}, "non-empty"),
        ({"max_new_tokens": 5, "stop_strings": "\n"}, "sequence of strings"),
        ({"max_new_tokens": 5, "stop_strings": (3,)}, "non-empty strings"),
        ({"max_new_tokens": 5, "eos_token_ids": (-1,)}, "non-negative"),
    ],
)
def test_stop_conditions_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(CloverError, match=match):
        StopConditions(**kwargs)


def test_stop_conditions_normalises_to_tuples() -> None:
    stop = StopConditions(max_new_tokens=3, eos_token_ids=[2, 0], stop_strings=["a"])  # type: ignore[arg-type]
    assert stop.eos_token_ids == (2, 0) and stop.stop_strings == ("a",)
    assert hash(stop) == hash(StopConditions(3, (2, 0), ("a",)))


# ------------------------------------------------------------------ min_tokens, offsets, released tokens


def test_stop_strings_are_not_matched_before_min_tokens(tok: Tokenizer) -> None:
    """A stop string completed by one of the first min_tokens tokens does not end generation; one completed later
    does, even when an earlier occurrence was skipped."""
    ids = tok.encode("a b stop c d stop e f", add_special_tokens=False)
    first = next(n for n in range(1, len(ids) + 1) if "stop" in tok.decode(ids[:n]))
    for min_tokens, cut in ((0, "a b "), (first, "a b "), (first + 1, "a b stop c d ")):
        for chunk in (1, 3, len(ids)):
            tracker = OutputTracker(tok, StopConditions(100, stop_strings=("stop",), min_tokens=min_tokens))
            text = "".join(tracker.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + tracker.flush()
            assert (text, tracker.finish_reason) == (cut, "stop"), (min_tokens, chunk)


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_text_offsets_and_released_tokens_follow_the_text_shown(tok: Tokenizer, text: str) -> None:
    """Each token's text offset is where its text starts; a token counts as released only once the text shown
    covers it (a held-back stop-string prefix or incomplete character holds its token back), all at the end."""
    ids = tok.encode(text, add_special_tokens=False)
    tracker = OutputTracker(
        tok, StopConditions(10_000, stop_strings=(text[len(text) // 2 : len(text) // 2 + 3] + "#",))
    )
    shown, released = "", 0
    for i in ids:
        shown += tracker.add([i])
        assert tracker.released >= released
        released = tracker.released
        assert shown.startswith(tok.decode(ids[:released]))  # released: their text is out, whole
    offsets = tracker.text_offsets()
    assert len(offsets) == len(ids) and offsets == sorted(offsets)
    for k, start in enumerate(offsets):
        prefix = tok.decode(ids[:k])
        assert start == len(prefix.rstrip("\ufffd")), (k, prefix)
    tracker.finish("length")
    tracker.flush()
    assert tracker.released == len(ids)


def test_a_held_back_stop_prefix_holds_back_its_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("one two wor three", add_special_tokens=False)
    k = next(n for n in range(len(ids)) if tok.decode(ids[: n + 1]).endswith("wor"))
    tracker = OutputTracker(tok, StopConditions(100, stop_strings=("world",)))
    assert tracker.add(ids[: k + 1]) == "one two " and tracker.released == k  # "wor" may be a stop string
    assert tracker.add(ids[k + 1 :]).startswith("wor") and tracker.released == len(ids)
