"""Grammar engines for structured output under speculation, measured on the CPU: llguidance, xgrammar, outlines-core.

The question: which engine should mask the verify tree's rows for response_format json_object / json_schema (and
a regex / grammar extension) so that speculative output stays equal to plain constrained decoding? Measured, on the
embedded base's real tokenizer (SmolLM2-135M-Instruct, 49,152 tokens), for four grammars (json_object and three JSON
schemas: small, medium, large) and engine by engine:

- vocabulary setup: the one-time per-tokenizer preprocessing (a server does it once at load);
- compile: schema -> compiled grammar -> a matcher (no compile cache), and the first mask after it (engines that
  compile lazily pay there);
- mask: the next-token bitmask [ceil(V/32)] int32 (bit t % 32 of word t // 32: token t allowed) at every position of
  a valid instance of the schema, tokenized (written as json.dumps writes it, then end-of-sequence), and the cost of
  consuming each token; each engine must allow every token of the instance (counted: "rejected");
- tree: what verifying a drafted tree needs, for the project's trees chain-4, small and mc26 (4, 9 and 25 drafted
  tokens, depth 4-5) rooted at 8 positions of the instance: depth first, a drafted token the parent's mask forbids is
  pruned with its subtree, an allowed one is consumed, its mask computed, its children visited, then rolled back. The
  first child of a node on the instance's path is the instance's next token, the others are drawn (seeded) from the
  tokens of all instances, so some are allowed and some not; every engine must prune the same nodes (counted:
  "disagreements"). xgrammar's own traverse_draft_tree (the same walk in C++) is timed beside it;
- fork: copying a matcher's state mid-instance (what walking a tree by copies instead of rollback costs);
- memory: in a fresh process per engine, the resident-set growth of importing it, its vocabulary setup, and
  compiling the four grammars with a matcher each; and the engine's own size figure where it has one.

Timed phases are interleaved: every repeat runs every engine on the same inputs, in an order rotated per repeat, so
a machine shared with other work slows all engines alike. Medians and 90th percentiles over tokens (or trees) and
repeats. Prints tables and writes benchmarks/results/grammar_engines.json (machine, date, commit).

Installs nothing. The engines measured, installed into the project's environment with
    pip install llguidance==1.9.1 xgrammar==0.2.8 outlines-core==0.2.14
(xgrammar 0.2.8 also pulls apache-tvm-ffi 0.1.15.post2 and requires torch, transformers and triton); an engine
that does not import is recorded with its error and left out.

    python benchmarks/grammar_engines.py [--repeats 5] [--compile-repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
ENGINES = ("llguidance", "xgrammar", "outlines-core")
TREES = ("chain-4", "small", "mc26")
TREE_POSITIONS = 8  # roots per instance for the tree walks
SEED = 20261127

# -- the grammars and a valid instance of each -------------------------------------------------------------

SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
MEDIUM = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items", "gift"],
    "additionalProperties": False,
}
_LARGE_FIELDS = {
    "id": {"type": "integer"},
    "username": {"type": "string"},
    "full_name": {"type": "string"},
    "email": {"type": "string"},
    "age": {"type": "integer"},
    "height_cm": {"type": "number"},
    "is_active": {"type": "boolean"},
    "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
    "country": {"type": "string"},
    "city": {"type": "string"},
    "street": {"type": "string"},
    "postal_code": {"type": "string"},
    "phone": {"type": "string"},
    "language": {"type": "string", "enum": ["en", "fr", "de", "es", "ja"]},
    "timezone": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"},
    "login_count": {"type": "integer"},
    "newsletter": {"type": "boolean"},
    "bio": {"type": "string"},
}
LARGE = {
    "type": "object",
    "properties": _LARGE_FIELDS,
    "required": list(_LARGE_FIELDS),
    "additionalProperties": False,
}
INSTANCES = {
    "json_object": {
        "title": "Weekly report",
        "metrics": {"visits": 1532, "conversion": 0.034, "sources": ["search", "email", "direct"]},
        "ok": True,
        "owner": None,
    },
    "small": {"name": "Ada Lovelace", "age": 36, "city": "London"},
    "medium": {
        "order_id": "A-10293",
        "status": "shipped",
        "customer": {"name": "Grace Hopper", "email": "grace@example.com", "tier": "pro"},
        "items": [
            {"sku": "KB-201", "quantity": 2, "unit_price": 49.5},
            {"sku": "MS-88", "quantity": 1, "unit_price": 19.99},
        ],
        "gift": False,
    },
    "large": {
        "id": 90210,
        "username": "kjohnson",
        "full_name": "Katherine Johnson",
        "email": "katherine@example.org",
        "age": 41,
        "height_cm": 167.5,
        "is_active": True,
        "role": "editor",
        "country": "United States",
        "city": "Hampton",
        "street": "12 Langley Road",
        "postal_code": "23666",
        "phone": "+1 757 555 0142",
        "language": "en",
        "timezone": "America/New_York",
        "tags": ["orbital mechanics", "navigation"],
        "score": 98.25,
        "login_count": 314,
        "newsletter": False,
        "bio": "Computed trajectories for early crewed spaceflight.",
    },
}
SCHEMAS: dict[str, dict | None] = {"json_object": None, "small": SMALL, "medium": MEDIUM, "large": LARGE}
OBJECT_SCHEMA = {"type": "object"}  # json_object: any JSON object


@dataclass(frozen=True)
class Workload:
    """One grammar and a valid instance of it, tokenized."""

    name: str
    schema: dict | None  # None: json_object mode
    text: str
    tokens: tuple[int, ...]  # the instance's tokens, then end-of-sequence


# -- the engines behind one interface ----------------------------------------------------------------------


class Engine:
    """One grammar engine: `setup` once per tokenizer, `compile` a grammar, `matcher` per request; a matcher writes
    the next-token bitmask into an int32 row, consumes tokens, rolls back and forks."""

    name = ""
    module = ""

    def setup(self, folder: Path, tok, eos: list[int]) -> None:
        raise NotImplementedError

    def compile(self, schema: dict | None) -> Any:
        raise NotImplementedError

    def matcher(self, grammar: Any) -> Any:
        raise NotImplementedError

    def fill(self, m: Any, row: np.ndarray) -> None:  # row: [W] int32, C-contiguous
        raise NotImplementedError

    def consume(self, m: Any, token: int) -> bool:
        raise NotImplementedError

    def rollback(self, m: Any, n: int) -> None:
        raise NotImplementedError

    def fork(self, m: Any) -> Any:
        raise NotImplementedError

    def size_bytes(self, grammar: Any) -> int | None:  # the engine's own size figure of a compiled grammar
        return None


class LLGuidance(Engine):
    name, module = "llguidance", "llguidance"

    def setup(self, folder, tok, eos):
        import llguidance

        self.llg = llguidance
        # tokenizer.json as it is; special tokens are never allowed except end-of-sequence
        self.tokenizer = llguidance.LLTokenizer(
            (folder / "tokenizer.json").read_text(), n_vocab=tok.vocab_size, eos_token=eos
        )

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema or OBJECT_SCHEMA)
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m  # a pristine matcher: requests start from copies of it

    def matcher(self, grammar):
        return grammar.deep_copy()

    def fill(self, m, row):
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, m, token):
        return m.consume_token(token)

    def rollback(self, m, n):
        m.rollback(n)

    def fork(self, m):
        return m.deep_copy()


class XGrammar(Engine):
    name, module = "xgrammar", "xgrammar"

    def setup(self, folder, tok, eos):
        import xgrammar

        self.xgr = xgrammar
        special = set(tok.backend.get_added_tokens_decoder())
        # byte-level tokens as tokenizer.json spells them; an empty string marks a special token (else xgrammar
        # reads "<|im_start|>" as text and allows it inside JSON strings)
        vocab = ["" if i in special and i not in eos else tok.id_to_token(i) for i in range(tok.vocab_size)]
        info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size, stop_token_ids=eos, add_prefix_space=False
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema):
        if schema is None:  # strict mode would forbid every property of a schema that lists none
            return self.compiler.compile_json_schema(json.dumps(OBJECT_SCHEMA), strict_mode=False)
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m, row):
        m.fill_next_token_bitmask(row[None])

    def consume(self, m, token):
        return m.accept_token(token)

    def rollback(self, m, n):
        m.rollback(n)

    def fork(self, m):
        return m.fork()

    def size_bytes(self, grammar):
        return int(grammar.memory_size_bytes)


class OutlinesCore(Engine):
    name, module = "outlines-core", "outlines_core"

    def setup(self, folder, tok, eos):
        import outlines_core

        self.oc = outlines_core
        special = set(tok.backend.get_added_tokens_decoder())
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if i not in special:  # end-of-sequence is the Vocabulary's own; other special tokens never match
                by_bytes.setdefault(tok.token_bytes(i), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], by_bytes)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema or OBJECT_SCHEMA))
        return self.oc.Index(regex, self.vocabulary)  # every state's allowed tokens, computed here

    def matcher(self, grammar):
        return self.oc.Guide(grammar, max_rollback=32)

    def fill(self, m, row):
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, m, token):
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, m, n):
        m.rollback_state(n)

    def fork(self, m):
        import copy

        return copy.copy(m)

    def size_bytes(self, grammar):
        import pickle

        return len(pickle.dumps(grammar))  # its serialized transition table


ENGINE_TYPES: dict[str, type[Engine]] = {e.name: e for e in (LLGuidance, XGrammar, OutlinesCore)}


# -- helpers -----------------------------------------------------------------------------------------------


def load_tokenizer():
    from clover.models.smollm2 import smollm2_dir
    from clover.runtime.tokenizer import Tokenizer

    folder = smollm2_dir()
    return folder, Tokenizer.from_dir(folder)


def workloads(tok) -> list[Workload]:
    eos = tok.eos_token_ids[0]
    out = []
    for name, schema in SCHEMAS.items():
        text = json.dumps(INSTANCES[name])
        out.append(Workload(name, schema, text, tuple(tok.encode(text, add_special_tokens=False)) + (eos,)))
    return out


def allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


def popcount(mask_row: np.ndarray, vocab: int) -> int:
    return int(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab].sum())


def stats(samples: list[float], scale: float = 1.0, digits: int = 3) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64) * scale
    return {
        "median": round(float(np.median(a)), digits),
        "p90": round(float(np.percentile(a, 90)), digits),
        "mean": round(float(a.mean()), digits),
        "max": round(float(a.max()), digits),
        "n": len(a),
    }


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_info(engine: Engine) -> dict[str, Any]:
    dist = engine.name
    meta = importlib.metadata.metadata(dist)
    requires = [r.split(";")[0].strip() for r in (meta.get_all("Requires-Dist") or []) if "extra ==" not in r]
    return {
        "version": importlib.metadata.version(dist),
        "license": meta.get("License-Expression") or meta.get("License"),
        "requires": requires,
    }


# -- the measurements --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeCase:
    """A drafted tree rooted after `position` tokens of a workload's instance."""

    workload: str
    tree: str
    position: int
    tokens: np.ndarray  # [T] int64 node tokens (node 0, the root, is the instance's token before `position`)


def tree_cases(loads: list[Workload]) -> list[TreeCase]:
    """Per workload and tree, TREE_POSITIONS roots spread over the instance; node tokens as the module docstring
    says (first child on the instance's path: its next token; every other node: a token of some instance)."""
    from clover.runtime.tree import resolve_tree

    rng = np.random.default_rng(SEED)
    eos = {w.tokens[-1] for w in loads}
    pool = np.array(sorted({t for w in loads for t in w.tokens} - eos), dtype=np.int64)
    cases = []
    for w in loads:
        n = len(w.tokens)
        positions = np.unique(np.linspace(1, n - 1, TREE_POSITIONS).astype(int))
        for p in positions:  # ascending: one matcher walks the instance and roots each tree on its way
            for name in TREES:
                tree = resolve_tree(name)
                tokens = rng.choice(pool, tree.num_nodes)
                tokens[0] = w.tokens[p - 1]
                on_path = np.zeros(tree.num_nodes, dtype=bool)
                on_path[0] = True
                for node in range(1, tree.num_nodes):
                    parent = int(tree.parent[node])
                    if on_path[parent] and node == tree.children[parent][0] and p + tree.depth[node] - 1 < n:
                        on_path[node] = True
                        tokens[node] = w.tokens[p + tree.depth[node] - 1]
                cases.append(TreeCase(w.name, name, int(p), tokens))
    return cases


def walk_tree(engine: Engine, m: Any, children: list, tokens: np.ndarray, masks: np.ndarray, eos: set) -> list[int]:
    """Masks of every node of a drafted tree whose path the grammar allows (masks[i]: after node i's path), depth
    first with rollback; the root's state is m's. Returns the allowed nodes (root included). End-of-sequence ends a
    path: its node is allowed but nothing follows it, so it gets no mask."""
    engine.fill(m, masks[0])
    kept = [0]
    stack = [(0, iter(children[0]))]
    while stack:
        node, kids = stack[-1]
        child = next(kids, None)
        if child is None:
            stack.pop()
            if node:
                engine.rollback(m, 1)
            continue
        t = int(tokens[child])
        if not allowed(masks[node], t):
            continue
        kept.append(child)
        if t in eos:
            continue
        if not engine.consume(m, t):
            raise RuntimeError(f"{engine.name} refused token {t} that its own mask allowed")
        engine.fill(m, masks[child])
        stack.append((child, iter(children[child])))
    return sorted(kept)


def sibling_layout(tree) -> tuple[np.ndarray, np.ndarray]:
    """The tree as first-child and next-sibling arrays ([T] int64 each, -1 where none): xgrammar's tree layout."""
    T = tree.num_nodes
    first, sibling = np.full(T, -1, dtype=np.int64), np.full(T, -1, dtype=np.int64)
    for node in range(T):
        kids = [int(c) for c in tree.children[node]]
        if kids:
            first[node] = kids[0]
        for a, b in zip(kids, kids[1:]):
            sibling[a] = b
    return first, sibling


Key = tuple[str, str]  # (engine, workload)


def setup_engines(names: list[str], folder: Path, tok) -> tuple[dict[str, Engine], dict[str, Any]]:
    """The engines that import, set up for the tokenizer; and per engine its package facts and setup time, or the
    error that left it out."""
    engines: dict[str, Engine] = {}
    info: dict[str, Any] = {}
    for name in names:
        engine = ENGINE_TYPES[name]()
        try:
            __import__(engine.module)
            t0 = time.perf_counter()
            engine.setup(folder, tok, list(tok.eos_token_ids))
            t1 = time.perf_counter()
        except Exception as e:  # an engine that fails to install or import is recorded, not fatal
            info[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: left out ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        engines[name] = engine
        info[name] = package_info(engine) | {"vocabulary_setup_s": round(t1 - t0, 3)}
    return engines, info


def measure_compile(engines: dict[str, Engine], loads: list[Workload], repeats: int, W: int):
    """Schema -> grammar -> matcher, then its first mask. Returns the compiled grammars and the two timings."""
    row = np.zeros(W, dtype=np.int32)
    compiled: dict[Key, Any] = {}
    compile_s: dict[Key, list[float]] = {}
    first_mask_s: dict[Key, list[float]] = {}
    for r in range(repeats):
        for w in loads:
            for name in rotated(list(engines), r):
                e = engines[name]
                gc.collect()
                t0 = time.perf_counter()
                grammar = e.compile(w.schema)
                m = e.matcher(grammar)
                t1 = time.perf_counter()
                e.fill(m, row)
                t2 = time.perf_counter()
                compiled[name, w.name] = grammar
                compile_s.setdefault((name, w.name), []).append(t1 - t0)
                first_mask_s.setdefault((name, w.name), []).append(t2 - t1)
    return compiled, compile_s, first_mask_s


def measure_instances(engines: dict[str, Engine], compiled: dict, loads: list[Workload], repeats: int, V: int, eos):
    """Mask and consume at every position of each instance. Returns the mask and consume times, the allowed tokens
    per position (first repeat) and how many instance tokens each engine refused (0 expected)."""
    row = np.zeros((V + 31) // 32, dtype=np.int32)
    clock = time.perf_counter
    mask_s: dict[Key, list[float]] = {}
    consume_s: dict[Key, list[float]] = {}
    allowed_counts: dict[Key, list[int]] = {}
    rejected: dict[Key, int] = {}
    for r in range(repeats):
        for w in loads:
            for name in rotated(list(engines), r):
                e, k = engines[name], (name, w.name)
                m = e.matcher(compiled[k])
                masks, cons, bad = [], [], 0
                gc.disable()
                for t in w.tokens:
                    t0 = clock()
                    e.fill(m, row)
                    t1 = clock()
                    masks.append(t1 - t0)
                    ok = allowed(row, t)
                    if t in eos:  # the sequence ends: nothing to consume
                        bad += not ok
                        break
                    t2 = clock()
                    ok = e.consume(m, t) and ok
                    cons.append(clock() - t2)
                    if not ok:
                        bad += 1
                        break
                gc.enable()
                mask_s.setdefault(k, []).extend(masks)
                consume_s.setdefault(k, []).extend(cons)
                rejected[k] = max(rejected.get(k, 0), bad)
                if r == 0:  # allowed tokens per position, untimed
                    m = e.matcher(compiled[k])
                    counts = []
                    for t in w.tokens:
                        e.fill(m, row)
                        counts.append(popcount(row, V))
                        if t in eos or not e.consume(m, t):
                            break
                    allowed_counts[k] = counts
    return mask_s, consume_s, allowed_counts, rejected


def measure_trees(engines: dict[str, Engine], compiled: dict, loads: list[Workload], repeats: int, W: int, eos):
    """Every tree case walked by every engine (and by xgrammar's traverse_draft_tree). Returns the cases, the walk
    times by (engine, workload, tree), the native walk's by (workload, tree), the allowed nodes by (workload, case
    index) and engine, and how often the native walk's masks differed from the walk's."""
    from clover.runtime.tree import resolve_tree

    cases = tree_cases(loads)
    trees = {n: resolve_tree(n) for n in TREES}
    children = {n: [list(map(int, c)) for c in t.children] for n, t in trees.items()}
    layout = {}
    if "xgrammar" in engines:  # its tree walk takes torch tensors (xgrammar requires torch)
        import torch

        layout = {n: tuple(map(torch.from_numpy, sibling_layout(t))) for n, t in trees.items()}
    clock = time.perf_counter
    tree_s: dict[tuple[str, str, str], list[float]] = {}
    native_s: dict[Key, list[float]] = {}
    kept: dict[tuple[str, int], dict[str, list[int]]] = {}
    native_differs = 0
    for r in range(repeats):
        for w in loads:
            for name in rotated(list(engines), r):
                e = engines[name]
                m = e.matcher(compiled[name, w.name])
                at = 0
                for i, case in enumerate(cases):
                    if case.workload != w.name:
                        continue
                    while at < case.position:  # the committed state: the instance's first `position` tokens
                        if not e.consume(m, w.tokens[at]):
                            raise RuntimeError(f"{name} refused the {w.name} instance's token {at}")
                        at += 1
                    masks = np.zeros((len(case.tokens), W), dtype=np.int32)  # [T, W]
                    gc.disable()
                    t0 = clock()
                    nodes = walk_tree(e, m, children[case.tree], case.tokens, masks, eos)
                    t1 = clock()
                    gc.enable()
                    tree_s.setdefault((name, w.name, case.tree), []).append(t1 - t0)
                    kept.setdefault((w.name, i), {})[name] = nodes
                    if name == "xgrammar":  # its own walk: GrammarMatcher.traverse_draft_tree, one C++ call
                        native = np.zeros_like(masks)
                        args = (*layout[case.tree], torch.from_numpy(case.tokens), torch.from_numpy(native))
                        gc.disable()
                        t0 = clock()
                        m.traverse_draft_tree(*args)
                        t1 = clock()
                        gc.enable()
                        native_s.setdefault((w.name, case.tree), []).append(t1 - t0)
                        live = [n for n in nodes if int(case.tokens[n]) not in eos]
                        native_differs += r == 0 and not np.array_equal(native[live], masks[live])
    return cases, tree_s, native_s, kept, native_differs


def measure_fork(engines: dict[str, Engine], compiled: dict, large: Workload, repeats: int) -> dict[str, list[float]]:
    """A copy of a matcher halfway through the large instance, 50 times a repeat."""
    fork_s: dict[str, list[float]] = {}
    for r in range(repeats):
        for name in rotated(list(engines), r):
            e = engines[name]
            m = e.matcher(compiled[name, large.name])
            for t in large.tokens[: len(large.tokens) // 2]:
                e.consume(m, t)
            samples = []
            for _ in range(50):
                t0 = time.perf_counter()
                e.fork(m)
                samples.append(time.perf_counter() - t0)
            fork_s.setdefault(name, []).extend(samples)
    return fork_s


def run(engine_names: list[str], repeats: int, compile_repeats: int) -> dict[str, Any]:
    """Every measurement but memory, as the results' sections."""
    from clover.runtime.tree import resolve_tree

    folder, tok = load_tokenizer()
    V = tok.vocab_size
    W = (V + 31) // 32
    eos = set(tok.eos_token_ids)
    loads = workloads(tok)
    engines, info = setup_engines(engine_names, folder, tok)
    compiled, compile_s, first_mask_s = measure_compile(engines, loads, compile_repeats, W)
    mask_s, consume_s, allowed_counts, rejected = measure_instances(engines, compiled, loads, repeats, V, eos)
    cases, tree_s, native_s, kept, native_differs = measure_trees(engines, compiled, loads, repeats, W, eos)
    fork_s = measure_fork(engines, compiled, next(w for w in loads if w.name == "large"), repeats)

    def allowed_nodes(name: str, workload: str, tree: str) -> float:
        """Mean allowed nodes (root included) of one tree's cases on one workload, by one engine."""
        counts = [
            len(kept[workload, i][name]) for i, c in enumerate(cases) if c.workload == workload and c.tree == tree
        ]
        return round(float(np.mean(counts)), 2)

    results: dict[str, Any] = {}
    for name, e in engines.items():
        per: dict[str, Any] = {}
        for w in loads:
            k = (name, w.name)
            per[w.name] = {
                "compile_ms": stats(compile_s[k], 1e3),
                "first_mask_ms": stats(first_mask_s[k], 1e3),
                "mask_us": stats(mask_s[k], 1e6, 1),
                "consume_us": stats(consume_s[k], 1e6, 1),
                "allowed_tokens_mean": round(float(np.mean(allowed_counts[k])), 1),
                "rejected_instance_tokens": rejected[k],
                "engine_size_bytes": e.size_bytes(compiled[k]),
                "tree_ms": {
                    t: stats(tree_s[name, w.name, t], 1e3) | {"allowed_nodes_mean": allowed_nodes(name, w.name, t)}
                    for t in TREES
                },
            }
            if name == "xgrammar":
                per[w.name]["traverse_draft_tree_ms"] = {t: stats(native_s[w.name, t], 1e3) for t in TREES}
        per["fork_us"] = stats(fork_s[name], 1e6, 1)
        results[name] = per
    trees = {n: resolve_tree(n) for n in TREES}
    return {
        "engines": info,
        "workloads": {
            w.name: {
                "schema_properties": len((w.schema or {}).get("properties", {})),
                "instance": w.text,
                "tokens": len(w.tokens),
            }
            for w in loads
        },
        "trees": {
            n: {"nodes": t.num_nodes, "drafted": t.num_nodes - 1, "depth": int(t.max_depth)} for n, t in trees.items()
        },
        "tree_cases": len(cases),
        # cases where the engines' allowed nodes differ (0 expected)
        "tree_disagreements": sum(1 for v in kept.values() if len({tuple(x) for x in v.values()}) > 1),
        "traverse_draft_tree_differs": native_differs,  # cases where xgrammar's native masks differ from its walk's
        "results": results,
    }


# -- memory, one fresh process per engine ------------------------------------------------------------------


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_probe(name: str) -> dict[str, Any]:
    """In this (fresh) process: the time and resident-set growth of importing the engine (and whether that imported
    torch), of its vocabulary setup, and of compiling every grammar with one matcher each."""
    folder, tok = load_tokenizer()
    loads = workloads(tok)
    engine = ENGINE_TYPES[name]()
    gc.collect()
    r0, t0 = rss_bytes(), time.perf_counter()
    __import__(engine.module)
    r1, t1 = rss_bytes(), time.perf_counter()
    engine.setup(folder, tok, list(tok.eos_token_ids))
    r2 = rss_bytes()
    held = []
    row = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    for w in loads:
        g = engine.compile(w.schema)
        m = engine.matcher(g)
        engine.fill(m, row)
        held.append((g, m))
    gc.collect()
    r3 = rss_bytes()
    mib = 2.0**20
    return {
        "import_s": round(t1 - t0, 3),
        "torch_imported": "torch" in sys.modules,
        "import_mib": round((r1 - r0) / mib, 1),
        "vocabulary_mib": round((r2 - r1) / mib, 1),
        "grammars_mib": round((r3 - r2) / mib, 1),
    }


def memory(names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-probe", name], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            out[name] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
        else:
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# -- report ------------------------------------------------------------------------------------------------


def print_tables(doc: dict[str, Any]) -> None:
    res = doc["results"]
    print(
        "\nengine         grammar      tokens  compile ms  1st mask ms  mask us med/p90   consume us  allowed  rejected"
    )
    for name, per in res.items():
        for wl, r in per.items():
            if wl == "fork_us":
                continue
            print(
                f"{name:<14} {wl:<12} {doc['workloads'][wl]['tokens']:>6} {r['compile_ms']['median']:>11.2f} "
                f"{r['first_mask_ms']['median']:>12.3f} {r['mask_us']['median']:>8.1f} / {r['mask_us']['p90']:<8.1f} "
                f"{r['consume_us']['median']:>10.1f} {r['allowed_tokens_mean']:>8.0f} {r['rejected_instance_tokens']:>9}"
            )
    print("\ntree walk ms, median / p90 (allowed nodes of the tree's, mean)")
    head = "".join(f"{t + ' (' + str(doc['trees'][t]['nodes']) + ')':>26}" for t in TREES)
    print(f"{'engine':<24} {'grammar':<12}{head}")
    for name, per in res.items():
        for wl, r in per.items():
            if wl == "fork_us":
                continue
            rows = [(name, r["tree_ms"])]
            if "traverse_draft_tree_ms" in r:
                rows.append(("xgrammar (native walk)", r["traverse_draft_tree_ms"]))
            for label, tm in rows:
                cells = "".join(
                    f"{tm[t]['median']:>9.3f} / {tm[t]['p90']:<7.3f}"
                    + (f" ({r['tree_ms'][t]['allowed_nodes_mean']:>4.1f})" if label == name else " " * 7)
                    for t in TREES
                )
                print(f"{label:<24} {wl:<12}{cells}")
    print(
        f"\ntree cases {doc['tree_cases']}, engines disagreeing on the allowed nodes: {doc['tree_disagreements']}, "
        f"xgrammar's traverse_draft_tree differing from its walk: {doc['traverse_draft_tree_differs']}"
    )
    print(
        "\nengine          version   license      import s  vocab setup s  fork us  memory MiB (import/vocab/grammars)"
    )
    for name, e in doc["engines"].items():
        if "error" in e:
            print(f"{name:<15} left out: {e['error']}")
            continue
        mem = doc["memory"].get(name, {})
        m = (
            f"{mem.get('import_mib')}/{mem.get('vocabulary_mib')}/{mem.get('grammars_mib')}"
            if "error" not in mem
            else mem["error"]
        )
        print(
            f"{name:<15} {e['version']:<9} {e['license']:<12} {mem.get('import_s', float('nan')):>8.2f} "
            f"{e['vocabulary_setup_s']:>14.2f} "
            f"{res[name]['fork_us']['median']:>8.1f}  {m}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the mask, tree and fork measurements")
    ap.add_argument("--compile-repeats", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    ap.add_argument("--json", type=Path, default=RESULTS / "grammar_engines.json")
    ap.add_argument("--note", default="", help="recorded in the results (e.g. what else the machine was running)")
    ap.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(memory_probe(args.memory_probe)))
        return 0
    names = [n for n in args.engines.split(",") if n]
    unknown = [n for n in names if n not in ENGINE_TYPES]
    if unknown:
        ap.error(f"unknown engines {unknown}; available: {', '.join(ENGINES)}")

    from clover import atomic
    from clover.tools.machine import host

    t0 = time.perf_counter()
    doc = {
        "benchmark": "grammar_engines",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "host": host(),
        "note": args.note,
        "repeats": args.repeats,
        "compile_repeats": args.compile_repeats,
        "tokenizer": "SmolLM2-135M-Instruct (49,152 tokens)",
    }
    doc |= run(names, args.repeats, args.compile_repeats)
    doc["memory"] = memory([n for n in names if "error" not in doc["engines"][n]])
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    print_tables(doc)
    atomic.write_text(args.json, json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.json} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
