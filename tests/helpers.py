"""Shared test fixtures: tiny random base models, a tiny tokenizer, the oracle draft runner, and the one token
identity assertion (`assert_identical`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from clover.models.config import BaseConfig, RopeConfig
from clover.models.decoder import Decoder, causal_mask
from clover.runtime.backend import Runner, RunnerInfo
from clover.runtime.backends.torch_runner import TorchRunner
from clover.tools.bench import first_difference
from clover.tools.serve import free_port, wait_healthy

# A few sentences to train throw-away BPE tokenizers on.
TOKENIZER_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and verifies them",
    "clover heads predict several tokens per step",
] * 10


@contextlib.contextmanager
def script_module(path: Path, also_drop: Sequence[str] = ()) -> Iterator:
    """A script (benchmarks/*.py) imported as the module of its file's name, in sys.modules while in use (dataclasses
    resolve their module by name); removed afterwards, with `also_drop` (modules it imported from beside it)."""
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for n in (name, *also_drop):
            sys.modules.pop(n, None)


def shared_root(root: Path) -> Path:
    """`root`, a session's base temp dir; under pytest-xdist, the folder every worker of the run shares (the
    workers' base temp dirs are its popen-gwN subfolders), so what a session builds once is built once per run
    rather than once per worker."""
    root = Path(root)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return root.parent if worker and root.name == f"popen-{worker}" else root


def built_once(out: Path, build) -> Path:
    """`out` built by `build(out)` once per run: the first process to get here builds it while holding a lock on
    it, and the others wait for it and find it done (a marker beside it, written last). A build that failed is
    retried."""
    import fcntl
    import shutil

    out = Path(out)
    done = out.parent / f".{out.name}.built"
    if done.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            build(out)
            done.write_text(f"{time.perf_counter() - start:.1f} s\n")  # what the build cost, for docs/testing.md
    return out


def tiny_config(vocab: int = 96, family: str = "LlamaForCausalLM", max_context: int = 256, **kw) -> BaseConfig:
    base = dict(
        architecture=family,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=max_context,
        tie_word_embeddings=True,
    )
    base.update(kw)
    return BaseConfig(**base)


def tiny_base(seed: int = 0, scale: float = 1.0, **kw) -> Decoder:
    """A random-init decoder; `scale` multiplies the embedding (smaller = flatter next-token laws)."""
    torch.manual_seed(seed)
    model = Decoder(tiny_config(**kw))
    for name, p in model.named_parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.02 if "embed" not in name else 1.0 * scale)
    return model.eval().requires_grad_(False)


def tiny_tokenizer_dir(path: Path, vocab: int = 96, eos: int = 1) -> Path:
    """A word-level tokenizer over words w0..w{vocab-1} (w1 = EOS) with a trivial chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": f"w{eos}",
                "bos_token": "w2",
                "chat_template": "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}",
            }
        )
    )
    return path


CHARS = "".join(chr(c) for c in range(0x20, 0x7F))  # the 95 printable ASCII characters


def char_tokenizer_dir(path: Path, eos: int = 1, chars: str = CHARS) -> Path:
    """A tokenizer with one token per character of `chars` and `<eos>` at id `eos`: by default the tiny model's 96
    ids, spelling any printable ASCII text. Grammars need a vocabulary that can spell any text (within their
    alphabet); the word-level one cannot."""
    from tokenizers import Tokenizer, decoders, models

    pieces = list(chars)
    pieces.insert(eos, "<eos>")
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token=None))
    tok.add_special_tokens(["<eos>"])
    tok.decoder = decoders.Fuse()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    return path


def tiny_hf_folder(path: Path, seed: int = 0) -> Path:
    """A random-init transformers Llama saved as an HF folder, with the tiny tokenizer: a --base for CLI tests.
    Deterministic in `seed`, so a run's workers can share one (built_once)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return tiny_tokenizer_dir(path)


class OracleDraft:
    """A draft that proposes the base model's own greedy continuation (`reference`) at rank 0 of every
    node, and arbitrary distinct tokens at other ranks. With greedy decoding every drafted path along
    rank 0 is accepted, which exercises long accepted paths and their KV compaction. Mixed into a
    backend's runner (before it), so any backend can run with it."""

    reference: list[int]
    rng: np.random.Generator

    def _logits_for(self, index: int, n: int) -> np.ndarray:
        logits = self.rng.standard_normal((n, self.info.vocab_size)).astype(np.float32)
        if index < len(self.reference):
            logits[:, self.reference[index]] = 100.0
        return logits

    def _draft_begin(self, slot):
        # the root is sequence index past; its children are index past + 1
        return self._logits_for(slot.past + 1, 1)[0]

    def _draft_step(self, slot, depth, nodes, parents, tokens):
        return self._logits_for(slot.past + depth + 1, len(nodes))


class OracleRunner(OracleDraft, TorchRunner):
    """The oracle draft on the torch backend."""

    def __init__(self, base: Decoder, reference: list[int], seed: int = 0):
        super().__init__(base, None)
        self.reference = reference
        self.rng = np.random.default_rng(seed)
        self.info = RunnerInfo(
            "torch", base.config.vocab_size, base.config.max_position_embeddings, "oracle", None, "oracle"
        )


def run_tokens(
    runner, prompt: list[int], tree, n: int, sampling=None, seed: int = 0, drafts: str = "heads"
) -> tuple[list[int], list[int]]:
    """The first n tokens the loop emits, and the tokens emitted by each verify step (greedy by default)."""
    from clover.runtime.loop import speculative_steps
    from clover.runtime.params import GenerationParams
    from clover.runtime.sampling import SamplingParams

    sampling = sampling or SamplingParams()
    if not sampling.greedy and sampling.seed is None:  # the loop's draws come from a generator of this seed
        sampling = dataclasses.replace(sampling, seed=seed)
    params = GenerationParams(max_new_tokens=n, sampling=sampling)
    out, steps = [], []
    for i, step in enumerate(speculative_steps(runner, np.array(prompt), tree, params, drafts)):
        out += step.tokens
        if i:
            steps.append(len(step.tokens))
        if len(out) >= n:
            break
    return out[:n], steps


def assert_identical(
    got, want, what: str = "", reference: Runner | None = None, prompt: list[int] | None = None
) -> None:
    """Fail, on one line, unless token lists `got` and `want` are equal: the first index where they differ (a
    prefix counts: the shorter one's length), the two tokens there and, given the `reference` runner and the
    `prompt`, the top-2 margin of its plain greedy logits at that index (near 0: a near tie, where rounding
    alone can flip the argmax; large: a real bug)."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if got == want:
        return
    i = first_difference(got, want)
    if i == min(len(got), len(want)):
        msg = f"tokens differ at index {i}: one output is a prefix of the other, lengths {len(got)} vs {len(want)}"
    else:
        msg = f"tokens diverge at index {i}: {got[i]} vs {want[i]}"
    if reference is not None and prompt is not None and len(prompt) + i <= reference.info.max_context:
        margin = greedy_margin(reference, prompt, want[:i])
        msg += f"; {reference.info.backend} reference top-2 logit margin there {margin:.3g}"
    raise AssertionError(f"{what}: {msg}" if what else msg)


def greedy_margin(runner: Runner, prompt: list[int], tokens: list[int]) -> float:
    """Top-1 minus top-2 logit of `runner`'s next token after `prompt` + `tokens`, decoded as plain steps on a
    slot of its own (the solo sequence is left alone)."""
    seq = np.asarray(list(prompt) + list(tokens), dtype=np.int64)
    P = len(prompt)
    slot = runner.open_slot(len(seq))
    try:
        logits = runner.forward(seq[:P], np.arange(P), np.tri(P, dtype=bool), last_only=True, slot=slot)[-1]  # [V]
        for k in range(P, len(seq)):
            runner.commit(
                np.arange(slot.pending), seq[k - slot.pending + 1 : k + 1], slot=slot
            )  # each row's next token
            logits = runner.forward(seq[k : k + 1], np.zeros(1, np.int64), np.ones((1, 1), bool), slot=slot)[0]
    finally:
        runner.release(slot)
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter (imports blocked there stay blocked); its stdout, after exit code 0."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


class Server:
    """clover-serve's app over `engine` under uvicorn on 127.0.0.1 (a free port), in a thread of this process;
    `url` is its /v1 base."""

    def __init__(self, engine, model: str, api_key: str | None = None, limits=None, **app_options) -> None:
        """limits: a clover.serve.limits.RequestLimits (default: the server's, with ignore_eos allowed);
        app_options: the other fields of clover.serve.app.AppOptions (docs, metrics_need_key, tools, cors)."""
        from clover.serve.app import AppOptions, create_app
        from clover.serve.limits import RequestLimits
        from clover.tools.serve import serve

        self.engine, self.port = engine, free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        limits = limits or RequestLimits(allow_ignore_eos=True)
        app = create_app(engine, model, AppOptions(api_key=api_key, limits=limits, **app_options))
        box = {}
        self.thread = threading.Thread(
            target=serve, args=(app, "127.0.0.1", self.port, 5.0, lambda s: box.setdefault("s", s)), daemon=True
        )
        self.thread.start()
        if not wait_healthy(self.port, 30):
            raise AssertionError("the server did not become healthy in 30 s")
        self.server = box["s"]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def reference_features(base: Decoder, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One full causal pass of `ids`: the last-layer hidden states [T, H], and the top-k next-token ids and
    probabilities [T, k] (what a feature cache must hold for that sequence)."""
    keys, values = base.empty_cache(1, 0)
    out = base(
        torch.tensor([ids]),
        torch.arange(len(ids))[None],
        causal_mask(len(ids)),
        torch.zeros(1, dtype=torch.long),
        keys,
        values,
    )
    p, top = torch.topk(torch.softmax(out.logits[0], -1), k)
    return out.hidden_states[0], top, p


def tiny_corpus(base_dir, path):
    """A corpus 'grown' by the tiny base (its fingerprint; repetitive answers, so contexts recur)."""
    import dataclasses

    import numpy as np

    from clover.models.heads import BaseFingerprint
    from clover.models.loading import load_base
    from clover.train.corpus import Conversation, Corpus, GeneratorSpec, PromptSpec

    fingerprint = dataclasses.asdict(BaseFingerprint.of(load_base(base_dir, "float32")))
    corpus = Corpus.create(
        path,
        PromptSpec("file:x.jsonl", "0" * 16, 4, 0, 0.0, 16),
        GeneratorSpec("tiny", fingerprint, "ort", "float32", 12, (1,), "cafe"),
    )
    with corpus.writing():
        corpus.append(
            [
                Conversation(i, np.array([5, 6], np.int32), np.array([7, 8, 9, 7, 8, 9, 7, 8], np.int32), "length")
                for i in range(4)
            ],
            4,
            0,
        )
    return path


def rss_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


POISON = [5, 5, 5, 5, 5, 5]  # a prompt no test's other prompt starts with (the engine tests' ids are 6-89)


class Faulty:
    """A fault in one request's part of every step: the runner's `where` ("forward", "commit", "draft") raises for
    the slot whose prompt is POISON, every time it is asked (a forward raises whenever that slot is in it)."""

    def __init__(self, runner, where: str) -> None:
        self.slots, self.where, self.raised = [], where, 0
        forward_batch, commit, draft_begin = runner.forward_batch, runner.commit, runner.draft_begin

        def poisoned(slot) -> bool:
            return any(slot is s for s in self.slots)

        def fail():
            self.raised += 1
            raise RuntimeError(f"/secret/path {where} fault")

        def forward(batch):
            for v in batch:
                if v.last_only and v.slot.past == 0 and list(v.tokens[: len(POISON)]) == POISON:
                    self.slots.append(v.slot)
            if where == "forward" and any(poisoned(v.slot) for v in batch):
                fail()
            return forward_batch(batch)

        def commit_(path, next_tokens, slot=None):
            if where == "commit" and poisoned(slot):
                fail()
            return commit(path, next_tokens, slot=slot)

        def draft(slot=None):
            if where == "draft" and poisoned(slot):
                fail()
            return draft_begin(slot)

        runner.forward_batch, runner.commit, runner.draft_begin = forward, commit_, draft
