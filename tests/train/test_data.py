import json

import pytest
from helpers import tiny_tokenizer_dir

from clover.errors import CloverError
from clover.runtime.tokenizer import Tokenizer
from clover.train.data import (
    first_turn_prompt,
    iter_json_array,
    load_conversations,
    normalize,
    split,
    tokenize_conversation,
    turn_prompt,
)


def test_truncated_json_array_yields_whole_objects_only():
    text = json.dumps([{"a": 1}, {"b": [1, 2]}, {"c": "x"}])
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": [1, 2]}, {"c": "x"}]
    cut = text[: text.index('{"c"') + 5]  # truncated inside the third object
    assert list(iter_json_array(cut)) == [{"a": 1}, {"b": [1, 2]}]


def test_normalize_sharegpt_and_openai_forms():
    sg = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    oa = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    }
    assert normalize(sg) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert normalize(oa)[0] == {"role": "system", "content": "s"}
    assert normalize({"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]}) is None
    assert normalize({"conversations": [{"from": "human", "value": "x"}, {"from": "human", "value": "y"}]}) is None
    assert normalize({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": " "}]}) is None
    assert normalize({"text": "plain"}) is None


def test_prompt_files_take_lone_user_turns_and_training_data_does_not(tmp_path):
    lone = {"messages": [{"role": "user", "content": "hi"}]}
    sg = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"}]}
    assert normalize(lone) is None and normalize(sg) is None and normalize({"prompt": "hi"}) is None
    assert (
        normalize(lone, prompts=True)
        == normalize({"prompt": "hi"}, prompts=True)
        == [{"role": "user", "content": "hi"}]
    )
    assert normalize(sg, prompts=True)[-1] == {"role": "user", "content": "hi"}
    # an exchange followed by an unanswered user turn is kept as before (and its turn 2 has no prompt, below)
    assert (
        normalize(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ]
            },
            prompts=True,
        )[-1]["content"]
        == "c"
    )
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps(lone) + "\n" + json.dumps({"prompt": "yo"}) + "\n" + json.dumps({"prompt": " "}) + "\n")
    assert load_conversations(str(f), prompts=True) == [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "yo"}],
    ]
    with pytest.raises(CloverError, match="each with a user turn then an assistant turn"):
        load_conversations(str(f))
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path / "tok"))
    msgs = [{"role": "user", "content": "w5 w6"}]
    assert turn_prompt(tok, msgs, 1) == tok.encode_chat(msgs, add_generation_prompt=True)
    assert turn_prompt(tok, msgs, 2) is None
    two = msgs + [{"role": "assistant", "content": "w7"}, {"role": "user", "content": "w8"}]
    assert turn_prompt(tok, two, 2) is None  # only lone prompts gain a turn


def test_load_jsonl_errors(tmp_path):
    with pytest.raises(CloverError, match="not found"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{oops\n')
    with pytest.raises(CloverError, match="bad.jsonl:2 is not valid JSON"):
        load_conversations(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "no chat"}\n')
    with pytest.raises(CloverError, match="no usable conversations"):
        load_conversations(str(empty))


def test_split_is_deterministic_and_disjoint():
    convs = [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "a"}] for i in range(100)]
    a, b = split(convs, seed=3), split(convs, seed=3)
    assert a == b
    assert len(a.validation) == 2 and len(a.train) == 98
    assert split(convs, seed=4).validation != a.validation
    keys = {m[0]["content"] for m in a.train} | {m[0]["content"] for m in a.validation}
    assert len(keys) == 100


def test_assistant_mask_covers_exactly_the_assistant_turns(tmp_path):
    tok = Tokenizer.from_dir(tiny_tokenizer_dir(tmp_path))
    msgs = [
        {"role": "user", "content": "w10 w11"},
        {"role": "assistant", "content": "w20 w21 w22"},
        {"role": "user", "content": "w12"},
        {"role": "assistant", "content": "w23"},
    ]
    ids, mask = tokenize_conversation(tok, msgs, max_length=100)
    assert ids == tok.encode_chat(msgs, add_generation_prompt=False)
    # the template renders "w3 content w4" per message and "w5" as the generation prompt; the tokens
    # an assistant turn adds after "...w5" are what the model generates
    masked = [tok.decode([i]) for i, m in zip(ids, mask) if m]
    assert "w20" in masked and "w23" in masked and "w10" not in masked and "w12" not in masked
    assert first_turn_prompt(tok, msgs) == tok.encode_chat(msgs[:1], add_generation_prompt=True)
    short_ids, short_mask = tokenize_conversation(tok, msgs, max_length=5)
    assert len(short_ids) == len(short_mask) == 5
