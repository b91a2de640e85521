"""What clients written for vLLM's OpenAI server send, on the real server over a tiny artifact: explicit nulls, many
stop strings, and vLLM's utility routes (/ping, /version, /v1/models/{id}, /tokenize, /detokenize)."""

import json

import httpx
import pytest
from helpers import Server
from ort_helpers import tiny_artifact

from clover import __version__
from clover.runtime.engine import Engine, EngineOptions
from clover.runtime.tokenizer import Tokenizer

MODEL = "tiny"
KEY = "secret"
CHAT = [{"role": "user", "content": "w10 w20 w30"}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(tmp_path_factory.getbasetemp(), "clover2", attention="fused")


@pytest.fixture(scope="module")
def server(artifact):
    engine = Engine.load(artifact, log=None, options=EngineOptions(max_batch=2))
    s = Server(engine, MODEL, api_key=KEY)
    s.root = s.url.removesuffix("/v1")
    s.tok = Tokenizer.from_dir(artifact / "tokenizer")
    yield s
    s.close()
    engine.close()


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.root + path, json=body, headers=headers, timeout=60)


def test_null_means_not_given(server):
    nulls = dict(temperature=None, top_p=None, stream=None, presence_penalty=None, frequency_penalty=None)
    greedy = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 8})
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 8, "seed": 3, **nulls})
    assert greedy.status_code == r.status_code == 200, r.text
    again = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 8, "seed": 3})
    # null temperature is the default 1.0 (sampled), exactly as leaving it out: same seed, same text
    assert r.json()["choices"][0]["message"] == again.json()["choices"][0]["message"]
    body = {"model": MODEL, "prompt": "w10 w20", "temperature": None, "echo": None, "stream": None, "top_k": None}
    r = post(server, "/v1/completions", {**body, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    # an unknown field is still refused, null or not
    assert post(server, "/v1/completions", {**body, "max_tokens": 4, "temprature": None}).status_code == 400


def test_a_task_s_whole_until_list_is_taken(server):
    until = [f"w{i}" for i in range(60, 90)]  # 30 stop strings (lm-eval sends a task's whole list)
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "w10 w20", "max_tokens": 8, "temperature": 0, "stop": until},
    )
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "w10", "max_tokens": 2, "stop": until * 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"  # 90: over the default 64


def test_ping_version_and_one_model(server):
    assert httpx.get(server.root + "/ping").status_code == 200
    assert httpx.get(server.root + "/version").json() == {"version": __version__}
    auth = {"Authorization": f"Bearer {KEY}"}
    card = httpx.get(f"{server.url}/models/{MODEL}", headers=auth)
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    missing = httpx.get(f"{server.url}/models/other", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "w10 w20 w30", "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == server.tok.encode("w10 w20 w30") and got["count"] == len(got["tokens"])
    assert got["token_strs"] == [server.tok.id_to_token(t) for t in got["tokens"]] and got["max_model_len"] > 0
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == server.tok.encode_chat(CHAT)
    bare = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == server.tok.encode_chat(CHAT, add_generation_prompt=False) != chat["tokens"]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": server.tok.decode(got["tokens"], False)}
    # one input, a served model, ids in the vocabulary, and the key
    assert post(server, "/tokenize", {"prompt": "w1", "messages": CHAT}).status_code == 400
    assert post(server, "/tokenize", {"model": "other", "prompt": "w1"}).status_code == 404
    bad = post(server, "/detokenize", {"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "w1"}, key=None).status_code == 401


def test_echo_streams_the_prompt_first(server):
    body = {"model": MODEL, "prompt": "w10 w20", "max_tokens": 6, "temperature": 0, "echo": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    with httpx.stream(
        "POST", server.url + "/completions", json={**body, "stream": True}, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["text"] for e in events for c in e["choices"]]
    assert texts[0] == "w10 w20" and "".join(texts) == whole and whole.startswith("w10 w20")


def test_cors_preflight_and_origin(server):
    origin = {"Origin": "https://app.example.com"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    r = httpx.options(server.url + "/chat/completions", headers=preflight)  # no key: a preflight carries none
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.text
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    ok = httpx.post(
        server.url + "/completions",
        json={"model": MODEL, "prompt": "w10", "max_tokens": 2},
        headers={**origin, "Authorization": f"Bearer {KEY}"},
    )
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()
    assert httpx.post(server.url + "/completions", json={}, headers=origin).status_code == 401  # the key still counts

    from clover.serve.limits import Cors

    strict = Server(server.engine, MODEL, api_key=KEY, cors=Cors(origins=("https://app.example.com",)))
    closed = Server(server.engine, MODEL, api_key=KEY, cors=None)
    try:
        assert httpx.options(strict.url + "/models", headers=preflight).status_code == 200
        other = {**preflight, "Origin": "https://evil.example.com"}
        assert httpx.options(strict.url + "/models", headers=other).status_code == 400  # origin not allowed
        r = httpx.options(closed.url + "/models", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    finally:
        strict.close()
        closed.close()


def completion(server, **body):
    r = post(server, "/v1/completions", {"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_list_of_prompts_answers_each_as_alone(server):
    """lm-eval's shapes: a list of texts, of token-id lists, or one token-id list in a list; prompt p's choices are
    indexes p * n .. p * n + n - 1, each equal to that prompt sent alone (greedy), usage the sum."""
    texts = ["w10 w20", "w30 w31 w32", "w40"]
    ids = [server.tok.encode(t) for t in texts]
    alone = [completion(server, prompt=t, max_tokens=6) for t in texts]
    for prompt in (texts, ids):
        got = completion(server, prompt=prompt, max_tokens=6, n=2)
        assert [c["index"] for c in got["choices"]] == list(range(6))
        assert [c["text"] for c in got["choices"]] == [a["choices"][0]["text"] for a in alone for _ in (0, 1)]
        assert got["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert got["usage"]["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
    one = completion(server, prompt=[ids[1]], max_tokens=6)
    assert [c["text"] for c in one["choices"]] == [alone[1]["choices"][0]["text"]]
    r = post(
        server, "/v1/completions", {"model": MODEL, "prompt": texts, "max_tokens": 6, "temperature": 0, "stream": True}
    )
    streamed = ["", "", ""]
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                streamed[c["index"]] += c["text"]
    assert streamed == [a["choices"][0]["text"] for a in alone]


def test_max_tokens_0_with_echo_scores_the_prompt(server):
    """lm-eval's loglikelihood: echo + logprobs + max_tokens 0 over token-id lists answers each prompt alone with its
    tokens' log-probabilities (the first has none), the ones a max_tokens 1 answer puts before its token."""
    ids = [server.tok.encode(t) for t in ("w10 w20 w30", "w40 w41")]
    got = completion(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    one = completion(server, prompt=ids, max_tokens=1, echo=True, logprobs=1)
    assert got["usage"]["completion_tokens"] == 0
    assert got["usage"]["prompt_tokens"] == sum(map(len, ids))
    for p, (zero, first) in enumerate(zip(got["choices"], one["choices"])):
        assert zero["index"] == p and zero["finish_reason"] == "length"
        assert zero["text"] == server.tok.decode(ids[p])
        lp = zero["logprobs"]
        assert len(lp["tokens"]) == len(ids[p]) and lp["token_logprobs"][0] is None
        assert all(x < 0 for x in lp["token_logprobs"][1:])
        assert {k: v[: len(ids[p])] for k, v in first["logprobs"].items()} == lp
    for body, field in (
        ({"max_tokens": 0}, "echo"),  # nothing to answer
        ({"max_tokens": 0, "echo": True, "stream": True}, "echo"),
        ({"prompt": ["w1"] * 65}, "prompt"),
        ({"prompt": ["w1", ""]}, "prompt"),
    ):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "w1", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_vllm_s_own_fields(server):
    """structured_outputs as guided_* (tests/serve/test_structured.py runs the grammars); return_token_ids; truncate_prompt_tokens; priority 0 only; the chat template
    controls add_generation_prompt, continue_final_message and chat_template_kwargs."""
    base = {"model": MODEL, "prompt": "w10 w20", "max_tokens": 4, "temperature": 0}
    # the same grammar as guided_choice (which this word-level tokenizer cannot spell: the same 400, by its name)
    guided = post(server, "/v1/completions", {**base, "guided_choice": ["w7 w8", "w9"]}).json()["error"]
    structured = post(server, "/v1/completions", {**base, "structured_outputs": {"choice": ["w7 w8", "w9"]}})
    assert structured.json()["error"]["param"] == "structured_outputs"
    assert structured.json()["error"]["message"] == guided["message"].replace("guided_choice", "structured_outputs")
    got = completion(server, **base, return_token_ids=True)["choices"][0]
    assert got["prompt_token_ids"] == server.tok.encode("w10 w20")
    assert server.tok.decode(got["token_ids"]) == got["text"]
    cut = completion(server, **{**base, "prompt": "w1 w2 w10 w20"}, truncate_prompt_tokens=2)
    assert cut["usage"]["prompt_tokens"] == 2 and cut["choices"][0]["text"] == got["text"]
    assert completion(server, **base, priority=0)["choices"][0]["text"] == got["text"]
    # this tokenizer has no special tokens in the answer: written out or not, the same text
    assert completion(server, **base, skip_special_tokens=False)["choices"][0]["text"] == got["text"]
    words = completion(server, **{**base, "max_tokens": 8}, ignore_eos=True)["choices"][0]["text"].split()
    stop = words[3]
    cut = words[: words.index(stop)]  # the text before the stop word's first place, and the word itself
    for include, text in ((False, " ".join(cut) + " "), (True, " ".join([*cut, stop]))):
        body = {**base, "max_tokens": 8, "ignore_eos": True, "stop": [stop], "include_stop_str_in_output": include}
        for stream in (False, True):
            r = post(server, "/v1/completions", {**body, "stream": stream})
            got = "".join(c["choices"][0]["text"] for c in events(r) if c["choices"]) if stream else None
            assert (got if stream else r.json()["choices"][0]["text"]).strip() == text.strip(), (include, stream)
    free = completion(server, **{**base, "max_tokens": 8}, ignore_eos=True)["choices"][0]["text"].split()
    banned = completion(server, **{**base, "max_tokens": 8}, ignore_eos=True, bad_words=[free[1], " ".join(free[4:6])])
    words = banned["choices"][0]["text"].split()
    assert words != free and free[1] not in words
    assert not any(words[i : i + 2] == free[4:6] for i in range(len(words)))
    only = completion(server, **base, allowed_token_ids=[30, 31], return_token_ids=True)["choices"][0]
    assert set(only["token_ids"]) <= {30, 31} and len(only["token_ids"]) == 4

    def chat(**body):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "return_token_ids": True, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def tokenized(messages, add_generation_prompt):
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return post(server, "/tokenize", body).json()["tokens"]

    assert chat(messages=CHAT)["prompt_token_ids"] == tokenized(CHAT, True)
    assert chat(messages=CHAT, add_generation_prompt=False)["prompt_token_ids"] == tokenized(CHAT, False)
    started = [*CHAT, {"role": "assistant", "content": "w50 w51"}]
    ids = chat(messages=started, add_generation_prompt=False, continue_final_message=True)["prompt_token_ids"]
    closed = tokenized(started, False)
    assert ids == closed[: len(ids)] and ids[-2:] == server.tok.encode("w50 w51") and len(ids) < len(closed)
    assert chat(messages=CHAT, chat_template_kwargs={"enable_thinking": False})["prompt_token_ids"] == tokenized(
        CHAT, True
    )
    for path, body, field in (
        ("/v1/completions", {**base, "priority": 1}, "priority"),
        ("/v1/completions", {**base, "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ("/v1/completions", {**base, "allowed_token_ids": [5, 96]}, "allowed_token_ids"),  # past the vocabulary
        ("/v1/completions", {**base, "structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ):
        r = post(server, path, {"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_chat_echo_and_continuous_usage(server):
    """echo on chat puts the final assistant message's content before the answer (streamed first); a stream with
    continuous_usage_stats carries the usage so far in every chunk, ending at the request's usage."""
    started = [*CHAT, {"role": "assistant", "content": "w50 w51"}]
    body = {"model": MODEL, "messages": started, "max_tokens": 6, "temperature": 0, "add_generation_prompt": False}
    plain = post(server, "/v1/chat/completions", {**body, "continue_final_message": True}).json()
    echoed = post(server, "/v1/chat/completions", {**body, "continue_final_message": True, "echo": True}).json()
    answer = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "w50 w51" + answer
    streamed = post(
        server, "/v1/chat/completions", {**body, "continue_final_message": True, "echo": True, "stream": True}
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events(streamed) if c["choices"])
    assert text == "w50 w51" + answer
    # echo where the final message is the user's: nothing to put first
    user = post(server, "/v1/chat/completions", {**body, "messages": CHAT, "add_generation_prompt": True, "echo": True})
    alone = post(server, "/v1/chat/completions", {**body, "messages": CHAT, "add_generation_prompt": True})
    assert user.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "w10 w20",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": options,
            "ignore_eos": True,
        },
    )
    chunks = events(r)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and all(c["usage"]["prompt_tokens"] == 2 for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == counts[-1] == 6


def test_return_tokens_as_token_ids_names_tokens_by_id(server):
    """Log-probabilities name their tokens `token_id:ID` (vLLM's), completions with echo and chat alike."""
    ids = server.tok.encode("w10 w20")
    body = {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 2, "return_tokens_as_token_ids": True}
    lp = completion(server, **body)["choices"][0]["logprobs"]
    named = completion(server, **{**body, "return_tokens_as_token_ids": False})["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["token_id:10", "token_id:20"] and lp["token_logprobs"] == named["token_logprobs"]
    assert [int(t.removeprefix("token_id:")) for t in lp["tokens"]] == server.tok.encode(" ".join(named["tokens"]))
    r = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(
        c["token"].startswith("token_id:") and all(t["token"].startswith("token_id:") for t in c["top_logprobs"])
        for c in content
    )


def test_prompt_logprobs_in_vllm_s_shape(server):
    """prompt_logprobs k: None for the first prompt token, then each token's own log-probability and rank beside the
    k most likely (ranks 1..k), the same numbers echo's logprobs report; on chat beside the choices."""
    ids = server.tok.encode("w10 w20 w30 w40")
    got = completion(server, prompt=ids, max_tokens=2, prompt_logprobs=3)["choices"][0]["prompt_logprobs"]
    echo = completion(server, prompt=ids, max_tokens=2, echo=True, logprobs=1)["choices"][0]["logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i, entry in enumerate(got[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(echo["token_logprobs"][i], abs=1e-6)
        assert own["decoded_token"] == f"w{ids[i]}" and own["rank"] >= 1
        assert {v["rank"] for k, v in entry.items() if k != str(ids[i])} <= {1, 2, 3}
        assert len(entry) == (3 if own["rank"] <= 3 else 4)  # the top 3, and the token itself where it is not in them
        assert (own["rank"] == 1) == (own["logprob"] == max(v["logprob"] for v in entry.values()))
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None
