"""Tokenizer and chat template of a Hugging Face model folder, without transformers.

Reads the files transformers writes (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
`generation_config.json`, `config.json`) and reproduces what `AutoTokenizer` does with them for
decoder LLMs: encoding, decoding, EOS ids and chat-template rendering. Needs only `tokenizers` and
`jinja2`, so the CPU serving path stays free of torch and transformers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import tokenizers
from tokenizers import processors

from clover.errors import CloverError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# Special-token names transformers passes to chat templates (its `special_tokens_map`).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, EOS ids and chat template of a model folder.

    Build it with `Tokenizer.from_dir`; `save` writes the files back so that `from_dir` round-trips.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        config: dict[str, Any] | None = None,
        source: str = "<memory>",
    ) -> None:
        """Args:
        backend: the tokenizer (its post-processor decides which special tokens `encode` adds).
        special_tokens: `bos_token`, `eos_token`, `unk_token`, `pad_token` strings, where known.
        eos_token_ids: every id that ends generation.
        chat_template: Jinja chat template, or None.
        config: the raw `tokenizer_config.json` contents, kept so that `save` preserves them.
        source: where it was loaded from, for error messages.
        """
        self._backend = backend
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._chat_template = chat_template
        self._config = dict(config or {})
        self._source = source
        self._compiled_template: jinja2.Template | None = None
        self._takes_tools: bool | None = None  # template_takes_tools, read on first use
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' answers
        self._added: dict[int, str] | None = None  # added (special) tokens' contents by id, read on first use

    # ----------------------------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        Args:
            path: folder holding `tokenizer.json` (required) and optionally `tokenizer_config.json`,
                `chat_template.jinja`, `generation_config.json` and `config.json`.

        Returns:
            The tokenizer; `eos_token_ids` is the union of the EOS ids of all those files.

        Raises:
            CloverError: the folder or `tokenizer.json` is missing, or a file is not valid.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise CloverError(f"model folder {folder} does not exist or is not a directory")
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            found = sorted(p.name for p in folder.iterdir())
            raise CloverError(
                f"model folder {folder} has no {TOKENIZER_FILE} (a Hugging Face fast-tokenizer file is "
                f"required); found: {', '.join(found) if found else 'nothing'}"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise CloverError(f"cannot read {tokenizer_file}: {e}") from e

        config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        special_tokens = {key: _token_content(config.get(key), key, folder) for key in _SPECIAL_TOKEN_KEYS}
        _apply_bos_eos_flags(backend, config, special_tokens, folder)

        chat_template = _chat_template_from_config(config.get("chat_template"), folder)
        template_file = folder / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")

        eos_ids: list[int] = []
        eos_token = special_tokens.get("eos_token")
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.append(eos_id)
        for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
            eos_ids.extend(_eos_ids(_read_json(folder / name).get("eos_token_id"), folder / name))

        return cls(
            backend,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            chat_template=chat_template,
            config=config,
            source=str(folder),
        )

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` (if any) and the EOS ids.

        The EOS ids go to `generation_config.json` as `eos_token_id`; other keys of an existing
        `generation_config.json` there are kept. `Tokenizer.from_dir(path)` gives back an equal tokenizer.
        """
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / TOKENIZER_FILE))
        config = dict(self._config)
        config.update(self._special_tokens)
        if self._chat_template is not None:
            config.pop("chat_template", None)
            (folder / CHAT_TEMPLATE_FILE).write_text(self._chat_template, encoding="utf-8")
        _write_json(folder / TOKENIZER_CONFIG_FILE, config)
        generation_config = _read_json(folder / GENERATION_CONFIG_FILE)
        generation_config["eos_token_id"] = list(self._eos_token_ids)
        _write_json(folder / GENERATION_CONFIG_FILE, generation_config)

    # -------------------------------------------------------------------------------- properties

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the `eos_token` first, then generation_config / config ids."""
        return self._eos_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """The known `bos_token`, `eos_token`, `unk_token` and `pad_token` strings."""
        return dict(self._special_tokens)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as OpenAI's log-probabilities report them (`bytes`): an added
        (special) token's content, a byte-level BPE token's bytes (GPT-2's byte-to-character table reversed), a
        byte-fallback token `<0xHH>` its byte, else its text with SentencePiece's U+2581 as a space. May be a
        partial UTF-8 character."""
        if (hit := self._token_bytes.get(token_id)) is not None:
            return hit
        piece = self._backend.id_to_token(int(token_id)) or ""
        if self._added is None:
            self._added = {int(i): t.content for i, t in self._backend.get_added_tokens_decoder().items()}
        if token_id in self._added:
            out = self._added[token_id].encode("utf-8")
        elif isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel) and all(
            c in _UNICODE_BYTES for c in piece
        ):
            out = bytes(_UNICODE_BYTES[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])
        else:
            out = piece.replace("\u2581", " ").encode("utf-8")
        self._token_bytes[token_id] = out
        return out

    def token_text(self, token_id: int) -> str:
        """The token's text for log-probabilities: its bytes as UTF-8, or `bytes:\\xHH...` when they are not
        whole characters (OpenAI's convention)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    # ------------------------------------------------------------------------ encoding, decoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the post-processor adds (e.g. BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (no `clean_up_tokenization_spaces`: decoder LLMs' BPE tokenizers never want it)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers' `apply_chat_template`.

        Args:
            messages: `[{"role": ..., "content": ...}, ...]`; keys whose value is None are dropped. Tool use in
                OpenAI's shape: an assistant message's `tool_calls` (`[{"id", "type": "function", "function":
                {"name", "arguments"}}]`, arguments a JSON string or an object) and `tool` messages.
            add_generation_prompt: append the header that starts the assistant's reply.
            continue_final_message: end the text with the final message's content, open (its end-of-turn cut off),
                for the model to continue it; not with add_generation_prompt.
            template_kwargs: more variables for the template (Qwen3's `enable_thinking`, say); not one the
                renderer sets (messages, tools, add_generation_prompt, the special tokens).
            tools: OpenAI tool definitions (`{"type": "function", "function": {"name", "description",
                "parameters"}}`). A template that takes `tools` (Llama 3.1's, Qwen2.5's) renders them and the tool
                messages itself; for one that does not, they are written into the system message in the hermes
                format (`tool_prompt`), and tool calls and results as hermes text (`hermes_messages`) unless the
                template handles tool messages itself (it names the `tool` role, `tool_calls` or `tool_call_id`).

        Returns:
            The prompt text, special tokens included as text.

        Raises:
            CloverError: the model has no chat template, or the template rejected the messages.
        """
        template = self._template()
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise CloverError(f"chat messages must be a list of dicts, got {messages!r}")
        kwargs = dict(template_kwargs or {})
        taken = sorted(kwargs.keys() & {"messages", "tools", "add_generation_prompt", *self._special_tokens})
        if taken:
            raise CloverError(
                f"template variables {', '.join(taken)} are set by the renderer, not by the request",
                param="template_kwargs",
            )
        if continue_final_message and add_generation_prompt:
            raise CloverError(
                "continue_final_message continues the final message: it cannot add a generation prompt (send "
                "add_generation_prompt false with it)",
                param="continue_final_message",
            )
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        extra: dict[str, Any] = {}
        if self.template_takes_tools:
            messages = [_arguments_as_objects(m) for m in messages]  # templates write them with tojson
            if tools:
                extra["tools"] = tools
        elif _TOOL_MESSAGES.search(self._chat_template or ""):  # it renders (or refuses) tool messages itself
            messages = hermes_messages([_arguments_as_objects(m) for m in messages], tools, convert=False)
        else:
            messages = hermes_messages(messages, tools)
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self._special_tokens,
                **kwargs,
            )
        except CloverError:
            raise
        except jinja2.TemplateError as e:
            raise CloverError(f"chat template of {self._source} failed: {e}") from e
        return _open_final(text, messages[-1] if messages else {}) if continue_final_message else text

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (and so renders tool definitions and, as the
        templates that do, tool calls and results)."""
        if self._takes_tools is None:
            self._takes_tools = "tools" in jinja2.meta.find_undeclared_variables(
                _jinja_environment().parse(self._chat_template or "")
            )
        return self._takes_tools

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (apply_chat_template); no special tokens are added (the template holds
        them)."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt,
            tools,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy of this tokenizer whose chat template is `template` (Jinja text), replacing the model's own or
        adding one to a model that has none (a base model). The template is compiled here, so a syntax error
        fails at once."""
        out = Tokenizer(
            self._backend,
            special_tokens=self._special_tokens,
            eos_token_ids=self._eos_token_ids,
            chat_template=check_chat_template(template, "the chat template given"),
            config={k: v for k, v in self._config.items() if k != "chat_template"},
            source=self._source,
        )
        out._token_bytes, out._added = self._token_bytes, self._added
        return out

    def _template(self) -> jinja2.Template:
        if self._chat_template is None:
            names = self._config.get("chat_template")
            detail = ""
            if isinstance(names, list):
                found = sorted(str(t.get("name")) for t in names if isinstance(t, dict))
                detail = f" named 'default' (it has {found})"
            raise CloverError(
                f"model folder {self._source} has no chat template{detail} (a base model continues text; an "
                "instruct model ships a template): pass a template with --chat-template FILE_OR_TEMPLATE "
                "(Python: EngineOptions(chat_template=...)), or send plain text (clover-generate without --chat, "
                "/v1/completions)"
            )
        if self._compiled_template is None:
            try:
                self._compiled_template = _jinja_environment().from_string(self._chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise CloverError(f"chat template of {self._source} is not valid Jinja: {e}") from e
        return self._compiled_template

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={self._eos_token_ids}, has_chat_template={self.has_chat_template})"
        )


# ------------------------------------------------------------------------- user-given templates


def read_chat_template(spec: str | Path) -> str:
    """The chat template a user names, as vLLM's --chat-template takes it: a path to a file holding the template
    (a Path always is one), else the text itself is the template when it holds Jinja's "{" or a line break. The
    template is compiled, so a syntax error fails here, at load.

    Raises:
        CloverError: a name that looks like a path but is no readable file, or a template that is not valid Jinja.
    """
    if isinstance(spec, str) and not spec.strip():
        raise CloverError("--chat-template is empty: pass a template file, or the Jinja template itself")
    literal = isinstance(spec, str) and ("{" in spec or "\n" in spec)
    try:
        text = Path(spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as e:  # no such file, a name too long, a NUL, not UTF-8
        if literal:
            return check_chat_template(spec, "the chat template given")
        raise CloverError(
            f"--chat-template {str(spec)[:200]!r} is neither a readable template file ({type(e).__name__}: "
            f"{e}) nor a Jinja template (it has no '{{'): pass the path of a .jinja file, or the template itself"
        ) from None
    return check_chat_template(text, f"chat template file {spec}")


def check_chat_template(template: str, what: str) -> str:
    """`template`, once it compiles in the environment chat templates render in (CloverError naming `what`)."""
    if not isinstance(template, str) or not template.strip():
        raise CloverError(f"{what} is empty: a chat template is Jinja text that renders `messages`")
    try:
        _jinja_environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CloverError(f"{what} is not valid Jinja (line {e.lineno}: {e.message}): fix the template") from None
    return template


def write_chat_template(folder: str | Path, template: str) -> None:
    """Make `template` the chat template of the tokenizer files in `folder`, for clover and transformers alike:
    written to chat_template.jinja (which both read first), and dropped from tokenizer_config.json."""
    folder = Path(folder)
    (folder / CHAT_TEMPLATE_FILE).write_text(check_chat_template(template, "the chat template given"), "utf-8")
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    if "chat_template" in config:
        del config["chat_template"]
        _write_json(folder / TOKENIZER_CONFIG_FILE, config)


# ------------------------------------------------------------------------------ tools in the chat

TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool definitions as the system message's text for a template without tools: the hermes format (Hermes 2
    Pro's and Qwen2.5's, one JSON definition a line), which asks for calls as `<tool_call>JSON</tool_call>`."""
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, convert: bool = True
) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tool definitions appended to the system message
    (or a system message of their own first); with `convert`, an assistant's `tool_calls` as `<tool_call>` blocks
    after its text, and consecutive `tool` messages as one user message of `<tool_response>` blocks (as Qwen2.5's
    template writes them)."""
    out: list[dict[str, Any]] = [] if convert else list(messages)
    responses = False  # the last message out is tool responses
    for m in messages if convert else ():
        if m.get("role") == "tool":
            response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            responses = True
            continue
        responses = False
        calls = [_call_object(c) for c in m.get("tool_calls") or ()]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls or m.get("content") is None:  # other messages as they are
            blocks = [f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls]
            m["content"] = "\n".join(([_text(m["content"])] if m.get("content") else []) + blocks)
        out.append(m)
    if tools:
        text = tool_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_object(call: Any) -> dict[str, Any]:
    """An OpenAI tool call as hermes writes it: `{"name", "arguments"}`, the arguments an object."""
    function = call.get("function", call) if isinstance(call, dict) else {}
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": args}


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' `arguments` are objects: OpenAI sends them as JSON text, and templates write
    them with tojson (as vLLM hands them over)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                args = json.loads(function["arguments"])
            except ValueError:
                args = function["arguments"]
            call = {**call, "function": {**function, "arguments": args}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _text(content: Any) -> str:
    return "" if content is None else str(content)


# --------------------------------------------------------------------------------------- helpers


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed: character -> the byte it stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_BYTES = _byte_level_table()
# a template that names these renders (or refuses) tool messages itself
_TOOL_MESSAGES = re.compile(r"""['"]tool['"]|tool_calls|tool_call_id""")


def _jinja_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandboxed environment transformers renders chat templates in."""

    def raise_exception(message: str) -> None:
        raise CloverError(f"chat template rejected the messages: {message}")

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers overrides it the same way.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _read_json(path: Path) -> dict[str, Any]:
    """Contents of an optional JSON object file; {} when absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CloverError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CloverError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_content(value: Any, key: str, folder: Path) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict with "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CloverError(
        f"{folder / TOKENIZER_CONFIG_FILE}: {key} should be a string or a dict with a 'content' string, found {value!r}"
    )


def _chat_template_from_config(value: Any, folder: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
        return None
    raise CloverError(
        f"{folder / TOKENIZER_CONFIG_FILE}: chat_template should be a string or a list of "
        f"{{name, template}} dicts, found {type(value).__name__}"
    )


def _eos_ids(value: Any, path: Path) -> list[int]:
    """An `eos_token_id` entry: absent, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CloverError(f"{path}: eos_token_id should be an int or a list of ints, found {value!r}")
    return list(values)


def _apply_bos_eos_flags(
    backend: tokenizers.Tokenizer, config: dict[str, Any], special_tokens: dict[str, str | None], folder: Path
) -> None:
    """Honour explicit `add_bos_token` / `add_eos_token` flags as transformers does.

    When tokenizer_config.json sets either flag, transformers replaces tokenizer.json's post-processor
    with one that adds exactly the flagged tokens; without the flags, tokenizer.json's post-processor
    is used as is.
    """
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    pieces: list[tuple[str, str]] = []  # (token, position) with position "before" / "after"
    if config.get("add_bos_token") and special_tokens.get("bos_token") is not None:
        pieces.append((special_tokens["bos_token"], "before"))
    if config.get("add_eos_token") and special_tokens.get("eos_token") is not None:
        pieces.append((special_tokens["eos_token"], "after"))
    ids: list[tuple[str, int]] = []
    for token, _ in pieces:
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise CloverError(
                f"{folder / TOKENIZER_CONFIG_FILE} asks to add {token!r} to every sequence, but "
                f"{folder / TOKENIZER_FILE} has no such token"
            )
        ids.append((token, token_id))
    bos = "".join(f"{t}:0 " for t, where in pieces if where == "before")
    eos = "".join(f" {t}:0" for t, where in pieces if where == "after")
    bos1 = "".join(f" {t}:1" for t, where in pieces if where == "before")
    eos1 = "".join(f" {t}:1" for t, where in pieces if where == "after")
    single = f"{bos}$A:0{eos}"
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single}{bos1} $B:1{eos1}", special_tokens=list(dict.fromkeys(ids))
    )


def _open_final(text: str, final: dict[str, Any]) -> str:
    """`text` cut right after the final message's content (as transformers' continue_final_message): the model
    continues that message instead of starting a new one."""
    content = final.get("content")
    if isinstance(content, list):  # content parts: the last text part
        content = next((p.get("text") for p in reversed(content) if isinstance(p, dict) and p.get("text")), None)
    if not isinstance(content, str) or not content.strip():
        raise CloverError(
            "continue_final_message continues the final message: it needs text content", param="continue_final_message"
        )
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise CloverError(
        "the chat template does not write the final message's content as sent: it cannot be continued",
        param="continue_final_message",
    )
