"""Base-model features for head training, computed once and cached on disk.

Per token position t of every sequence the cache keeps:
- `tokens`     int32 [N]      x_t
- `hidden`     float16 [N, H] the base's last-layer hidden state h_t, before the final norm
- `topk_ids`   int32 [N, K]   the K most likely next tokens under the base, p_t = p(x_{t+1} | x_<=t)
- `topk_probs` float16 [N, K] their probabilities (not renormalised: the tail mass is left out)
- `loss_mask`  bool [N]       p_t is a distribution over an assistant token (x_{t+1} is one)
and per sequence its [start, end) offsets and whether it is held out for validation.
The last position of a sequence has no next token: zero features, loss_mask False. Distributions are
computed at loss positions only: the other rows' top-k are zeros.

Sources (FeatureSpec.responses): 'base' (the base answers while the features are built), 'dataset' (the
data's own assistant turns) and 'corpus' (a clover.train.corpus folder of the base's stored answers); the
last two run teacher-forced batches.

Arrays are raw little-endian files appended while building (so a build never holds the data set in
memory) and memory-mapped for training. A cache is built in a `.partial` sibling and renamed into
place when complete, so an interrupted build is never read as a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from clover import atomic
from clover.errors import CloverError
from clover.models.decoder import Decoder, causal_mask
from clover.train.data import interleave

if TYPE_CHECKING:
    from clover.train.corpus import Conversation

FORMAT_VERSION = 1
_ARRAYS = {
    "tokens": np.int32,
    "hidden": np.float16,
    "topk_ids": np.int32,
    "topk_probs": np.float16,
    "loss_mask": np.bool_,
}


@dataclass(frozen=True)
class FeatureSpec:
    """Everything that determines a feature cache's content; its hash names the cache folder."""

    base_sha256: str  # BaseFingerprint.lm_head_sha256 of the base the features come from
    data: str  # 'sharegpt' or the JSONL path
    responses: str  # 'dataset': the data's assistant turns; 'base': the base's own greedy answers
    max_tokens: int  # training loss tokens to collect (validation gets validation_fraction of it on top)
    seed: int  # conversation shuffle / split
    max_length: int  # tokens per sequence (prompt + response)
    max_new_tokens: int  # 'base' responses: longest answer generated
    topk: int
    validation_fraction: float = 0.02
    dtype: str = "float32"  # precision the base runs in while building (bfloat16: ~2x faster on CPU)
    corpus: str = ""  # responses 'corpus' (data: a clover.train.corpus folder): Corpus.digest of the shards used
    # who computes the features: "" the torch base in `dtype`; "ort:<digest>" an artifact's base graph on ONNX
    # Runtime (clover-train --features-from: the graph that will serve, e.g. int4), named by its files' sha256
    teacher: str = ""
    # corpus answers: train on each answer's first `answer_tokens` tokens only (0: the whole answer, up to max_length)
    answer_tokens: int = 0
    # corpus answers: leave out the training conversations that hold its first `skip_tokens` loss tokens (in corpus
    # order), so a run from earlier heads (--init) learns what the corpus gained since; validation is never skipped
    skip_tokens: int = 0

    @property
    def budgets(self) -> tuple[int, int]:
        """Loss tokens to collect: (training, validation)."""
        return self.max_tokens, max(1, round(self.max_tokens * self.validation_fraction))

    def key(self) -> str:
        later = ("corpus", "teacher", "answer_tokens", "skip_tokens")  # fields added later: unset, older names stay
        fields = {k: v for k, v in asdict(self).items() if k not in later or v}
        blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sweep_partials(path: Path) -> list[Path]:
    """Delete the `.partial-<pid>` siblings of `path` whose writing process is gone (killed: GBs nobody finishes)."""
    from clover.atomic import process_alive

    swept = []
    for entry in path.parent.glob(f"{path.name}.partial-*") if path.parent.is_dir() else ():
        pid = entry.name.rsplit("-", 1)[1]
        if pid.isdigit() and entry.is_dir() and not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry)
    return swept


class FeatureWriter:
    """Appends sequences' features to a `.partial` folder; `finish()` makes it a cache."""

    def __init__(self, path: Path, spec: FeatureSpec, hidden_size: int):
        self.path, self.spec, self.hidden_size = path, spec, hidden_size
        self.tmp = path.with_name(path.name + f".partial-{os.getpid()}")
        sweep_partials(path)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.files = {name: open(self.tmp / f"{name}.bin", "wb") for name in _ARRAYS}
        self.offsets = [0]
        self.validation: list[bool] = []
        self.loss_tokens = [0, 0]  # train, validation
        self.started = time.time()

    def add(
        self,
        tokens: np.ndarray,
        hidden: np.ndarray,
        topk_ids: np.ndarray,
        topk_probs: np.ndarray,
        loss_mask: np.ndarray,
        validation: bool,
    ) -> None:
        n = len(tokens)
        assert hidden.shape == (n, self.hidden_size) and topk_ids.shape == topk_probs.shape == (n, self.spec.topk)
        assert not loss_mask[-1], "the last position has no next token"
        for name, arr in (
            ("tokens", tokens),
            ("hidden", hidden),
            ("topk_ids", topk_ids),
            ("topk_probs", topk_probs),
            ("loss_mask", loss_mask),
        ):
            self.files[name].write(np.ascontiguousarray(arr, dtype=_ARRAYS[name]).tobytes())
        self.offsets.append(self.offsets[-1] + n)
        self.validation.append(validation)
        self.loss_tokens[validation] += int(loss_mask.sum())

    def add_batch(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_probs: torch.Tensor,
        loss_mask: torch.Tensor,
        validation: list[bool],
    ) -> None:
        """A right-padded batch ([B, L], [B], [B, L, H], [B, L, K] x 2, [B, L]) of sequences, one copy to the host."""
        arrays = [t.cpu().numpy() for t in (tokens, hidden, topk_ids, topk_probs, loss_mask)]
        for b, n in enumerate(lengths.tolist()):
            self.add(*(a[b, :n] for a in arrays), validation[b])

    def finish(self, extra: dict) -> FeatureCache:
        for f in self.files.values():
            f.close()
        np.save(self.tmp / "offsets.npy", np.array(self.offsets, dtype=np.int64))
        np.save(self.tmp / "validation.npy", np.array(self.validation, dtype=np.bool_))
        meta = {
            "format_version": FORMAT_VERSION,
            "spec": asdict(self.spec),
            "hidden_size": self.hidden_size,
            "num_tokens": self.offsets[-1],
            "num_sequences": len(self.validation),
            "train_loss_tokens": self.loss_tokens[0],
            "validation_loss_tokens": self.loss_tokens[1],
            "build_seconds": round(time.time() - self.started, 1),
            **extra,
        }
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        atomic.publish_folder(self.tmp, self.path)
        return FeatureCache(self.path)

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class MemoryWriter:
    """FeatureWriter's twin that keeps the features in memory on `device` (nothing written to disk): a GPU's
    memory holds the features of millions of tokens, so a run there builds them in a minute and never waits on
    a disk. `finish()` makes a FeatureStore."""

    def __init__(self, spec: FeatureSpec, hidden_size: int, device: torch.device):
        self.spec, self.hidden_size, self.device = spec, hidden_size, torch.device(device)
        self.parts: dict[str, list[torch.Tensor]] = {name: [] for name in _ARRAYS}
        self.lengths: list[int] = []
        self.validation: list[bool] = []
        self.loss_tokens = [0, 0]  # train, validation
        self.started = time.time()

    def add_batch(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_probs: torch.Tensor,
        loss_mask: torch.Tensor,
        validation: list[bool],
    ) -> None:
        """A right-padded batch (FeatureWriter.add_batch's shapes): its real positions appended, on the device."""
        L = tokens.shape[1]
        real = torch.arange(L, device=tokens.device)[None] < lengths.to(tokens.device)[:, None]  # [B, L]
        for name, t in zip(_ARRAYS, (tokens, hidden, topk_ids, topk_probs, loss_mask)):
            self.parts[name].append(t[real].to(self.device, _TORCH[name]))
        per_seq = loss_mask.sum(1).tolist()
        for n, v, c in zip(lengths.tolist(), validation, per_seq):
            self.lengths.append(n)
            self.validation.append(bool(v))
            self.loss_tokens[bool(v)] += int(c)

    def add(
        self,
        tokens: np.ndarray,
        hidden: np.ndarray,
        topk_ids: np.ndarray,
        topk_probs: np.ndarray,
        loss_mask: np.ndarray,
        validation: bool,
    ) -> None:
        assert not loss_mask[-1], "the last position has no next token"
        arrays = (tokens, hidden, topk_ids, topk_probs, loss_mask)
        for name, a in zip(_ARRAYS, arrays):
            self.parts[name].append(torch.from_numpy(np.ascontiguousarray(a, dtype=_ARRAYS[name])).to(self.device))
        self.lengths.append(len(tokens))
        self.validation.append(validation)
        self.loss_tokens[validation] += int(loss_mask.sum())

    def finish(self, extra: dict) -> FeatureStore:
        arrays = {name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in self.parts.items()}
        self.parts.clear()
        offsets = np.concatenate(([0], np.cumsum(self.lengths, dtype=np.int64)))
        meta = {
            "format_version": FORMAT_VERSION,
            "spec": asdict(self.spec),
            "hidden_size": self.hidden_size,
            "num_tokens": int(offsets[-1]),
            "num_sequences": len(self.validation),
            "train_loss_tokens": self.loss_tokens[0],
            "validation_loss_tokens": self.loss_tokens[1],
            "build_seconds": round(time.time() - self.started, 1),
            **extra,
        }
        return FeatureStore(arrays, offsets, np.array(self.validation, dtype=np.bool_), meta)

    def abort(self) -> None:
        self.parts.clear()


_TORCH = {
    "tokens": torch.int32,
    "hidden": torch.float16,
    "topk_ids": torch.int32,
    "topk_probs": torch.float16,
    "loss_mask": torch.bool,
}


class FeatureCache:
    """A finished cache, memory-mapped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise CloverError(f"{self.path} is not a feature cache (no meta.json): delete it and rebuild")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise CloverError(
                f"feature cache {self.path} has format {self.meta.get('format_version')}, this version "
                f"reads {FORMAT_VERSION}: delete it and rebuild"
            )
        self.spec = FeatureSpec(**self.meta["spec"])
        n, H, K = self.meta["num_tokens"], self.meta["hidden_size"], self.spec.topk
        shapes = {"tokens": (n,), "hidden": (n, H), "topk_ids": (n, K), "topk_probs": (n, K), "loss_mask": (n,)}
        self.arrays = {
            name: np.memmap(self.path / f"{name}.bin", dtype=_ARRAYS[name], mode="r", shape=shapes[name])
            for name in _ARRAYS
        }
        self.offsets = np.load(self.path / "offsets.npy")
        self.validation = np.load(self.path / "validation.npy")

    def sequences(self, validation: bool) -> list[int]:
        return [i for i, v in enumerate(self.validation) if bool(v) == validation]

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def batch(self, seq_ids: list[int]) -> dict[str, torch.Tensor]:
        """Right-padded tensors [B, L, ...] for sequences `seq_ids`; padding has loss_mask False."""
        L = max(self.length(i) for i in seq_ids)
        out: dict[str, torch.Tensor] = {}
        for name, arr in self.arrays.items():
            pad = np.zeros((len(seq_ids), L, *arr.shape[1:]), dtype=arr.dtype)
            for b, i in enumerate(seq_ids):
                s, e = self.offsets[i], self.offsets[i + 1]
                pad[b, : e - s] = arr[s:e]
            out[name] = torch.from_numpy(pad)
        out["length"] = torch.tensor([self.length(i) for i in seq_ids])
        return out


class FeatureStore:
    """Features held in memory as flat tensors on one device, with FeatureCache's reading interface: batches are
    gathered where the tensors live (on a GPU: no host work and no copy per batch). Built by MemoryWriter, loaded
    from a cache (`from_cache`), or several joined (`concat`: features of several corpora trained together)."""

    path = None  # nothing on disk

    def __init__(self, arrays: dict[str, torch.Tensor], offsets: np.ndarray, validation: np.ndarray, meta: dict):
        self.arrays, self.offsets, self.validation, self.meta = arrays, offsets, validation, meta
        self.spec = FeatureSpec(**meta["spec"])
        self.device = arrays["tokens"].device
        self._starts = torch.from_numpy(offsets[:-1]).to(self.device)  # [S]
        self._lengths = torch.from_numpy(np.diff(offsets)).to(self.device)  # [S]

    @classmethod
    def from_cache(cls, cache: FeatureCache, device: torch.device) -> FeatureStore:
        """A disk cache read whole onto `device` (through pinned memory for a GPU)."""
        device = torch.device(device)
        arrays = {}
        for name, arr in cache.arrays.items():
            if device.type == "cuda":  # read from disk into pinned memory once, then one copy to the device
                t = torch.empty(arr.shape, dtype=_TORCH[name], pin_memory=True)
                t.numpy()[:] = arr
                arrays[name] = t.to(device, non_blocking=True)
            else:
                arrays[name] = torch.from_numpy(np.array(arr))
        return cls(arrays, cache.offsets, cache.validation, dict(cache.meta, path=str(cache.path)))

    @classmethod
    def concat(cls, stores: list[FeatureStore]) -> FeatureStore:
        """Several stores as one (sequence ids follow the order given); meta sums the counts and lists the parts."""
        if len(stores) == 1:
            return stores[0]
        arrays = {name: torch.cat([s.arrays[name] for s in stores]) for name in _ARRAYS}
        offsets = np.concatenate(
            [[0]] + [s.offsets[1:] + sum(t.offsets[-1] for t in stores[:i]) for i, s in enumerate(stores)]
        )
        validation = np.concatenate([s.validation for s in stores])
        summed = ("num_tokens", "num_sequences", "train_loss_tokens", "validation_loss_tokens", "build_seconds")
        meta = dict(stores[0].meta, parts=[s.meta for s in stores])
        for key in summed:
            meta[key] = (
                round(sum(s.meta[key] for s in stores), 1)
                if key == "build_seconds"
                else sum(s.meta[key] for s in stores)
            )
        return cls(arrays, offsets.astype(np.int64), validation, meta)

    def sequences(self, validation: bool) -> list[int]:
        return [i for i, v in enumerate(self.validation) if bool(v) == validation]

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def batch(self, seq_ids: list[int]) -> dict[str, torch.Tensor]:
        """FeatureCache.batch's right-padded tensors, gathered on the store's device."""
        L = max(self.length(i) for i in seq_ids)
        ids = torch.tensor(seq_ids, device=self.device)
        lengths = self._lengths[ids]  # [B]
        steps = torch.arange(L, device=self.device)
        real = steps[None] < lengths[:, None]  # [B, L]
        pos = torch.where(real, self._starts[ids][:, None] + steps[None], 0)  # [B, L] flat positions
        out = {}
        for name, arr in self.arrays.items():
            x = arr[pos]
            out[name] = x * real.view(*real.shape, *([1] * (x.dim() - 2))) if name != "loss_mask" else x & real
        out["length"] = lengths
        return out

    def first_ranked(self, seq_ids: list[int]) -> torch.Tensor:
        """The base's first-ranked token at every loss position of `seq_ids` [n] (frequent_tokens' counts)."""
        chosen = torch.zeros(len(self.validation), dtype=torch.bool)
        chosen[seq_ids] = True
        per_pos = torch.repeat_interleave(chosen.to(self.device), self._lengths)  # [N]
        return self.arrays["topk_ids"][:, 0][self.arrays["loss_mask"] & per_pos]


# -- building --------------------------------------------------------------------------------------

Progress = Callable[[int, int], None]  # (loss tokens so far, budget)


@torch.inference_mode()
def _topk_tensors(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids int32 and probabilities float16 of `logits` [..., V], on its device."""
    probs, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return ids.to(torch.int32), probs.to(torch.float16)


def _topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids, probs = _topk_tensors(logits, k)
    return ids.cpu().numpy(), probs.cpu().numpy()


@torch.inference_mode()
def prefill(
    base: Decoder, ids: list[int], k: int, last_only: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[torch.Tensor], list[torch.Tensor]]:
    """One sequence through the base: hidden [T, H] fp16, top-k per position, and its K/V.
    `last_only`: the distribution of the last position only (the rows before it get zeros), for
    prompts whose own positions carry no loss: it skips most of the LM-head work."""
    T, dev = len(ids), _device(base)
    keys, values = base.empty_cache(1, 0)
    rows = torch.tensor([T - 1], device=dev) if last_only else None
    out = base(
        torch.tensor([ids], device=dev),
        torch.arange(T, device=dev)[None],
        causal_mask(T, device=dev),
        torch.zeros(1, dtype=torch.long, device=dev),
        keys,
        values,
        logit_rows=rows,
    )
    tk_ids, tk_p = _topk(out.logits[0], k)
    if last_only:
        tk_ids = np.concatenate((np.zeros((T - 1, k), tk_ids.dtype), tk_ids))
        tk_p = np.concatenate((np.zeros((T - 1, k), tk_p.dtype), tk_p))
    return out.hidden_states[0].to(torch.float16).cpu().numpy(), tk_ids, tk_p, out.new_keys, out.new_values


def _device(base: Decoder) -> torch.device:
    return base.lm_head.weight.device


FEATURE_DTYPES = ("float32", "bfloat16")  # what `fastest_feature_dtype` picks from (same held-out head accuracy)


def _cpu_key() -> str:
    """This machine's CPU as far as kernel speeds go: model name, flags, cores, torch version, torch threads."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((ln for ln in lines if ln.startswith("model name")), "")
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    blob = f"{model}|{flags}|{os.cpu_count()}|{torch.__version__}|{torch.get_num_threads()}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def remembered_fastest(memo_name: str, options: tuple[str, ...], seconds: Callable[[str], float]) -> str:
    """Of `options`, the one `seconds(option)` times fastest on this machine, timed once and remembered in the user
    cache (`memo_name`, keyed by `_cpu_key`), so that later runs and --resume choose the same."""
    from clover.cache import cache_dir

    memo = cache_dir() / memo_name
    key = _cpu_key()
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if known.get(key) in options:
        return known[key]
    timed = {option: seconds(option) for option in options}
    known[key] = best = min(timed, key=timed.get)
    try:
        atomic.write_text(memo, json.dumps(known, indent=1) + "\n")
    except OSError:
        pass  # a cache that cannot be written costs a timing next time
    return best


def fastest_feature_dtype(base_path: Path, load, rows: int = 256) -> str:
    """The base's faster precision for building features on this CPU (bfloat16 is 1.6x faster than float32 on an
    AMD EPYC with AVX-512, and 1.3x slower on an Intel Xeon without AMX), timed once per machine on one forward of
    `rows` tokens in each and remembered in the user cache, so that later runs and --resume agree. `load(path,
    dtype)` loads the base."""

    def seconds(dtype: str) -> float:
        base = load(base_path, dtype)
        ids = torch.randint(0, base.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(0))
        keys, values = base.empty_cache(1, 0)
        args = (ids, torch.arange(rows)[None], causal_mask(rows, 1, ids.device), torch.zeros(1, dtype=torch.long))
        with torch.no_grad():
            times = []
            for _ in range(3):  # the first warms the kernels up
                t = time.perf_counter()
                base(*args, keys, values, logit_rows=torch.arange(rows))
                times.append(time.perf_counter() - t)
        return min(times[1:])

    return remembered_fastest("feature_dtype.json", FEATURE_DTYPES, seconds)


@torch.inference_mode()
def features_from_dataset(
    base: Decoder,
    sequences: Iterable[tuple[list[int], list[bool], bool]],
    writer: FeatureWriter,
    budgets: tuple[int, int],
    progress: Progress | None = None,
    batch_tokens: int = 8192,
    window: int = 64,
) -> None:
    """Teacher-forced passes over tokenised conversations: (ids, assistant mask, is_validation) each.

    Several sequences share a forward on the base's device (right-padded, at most `batch_tokens` padded tokens;
    sorted by length within windows of `window` sequences so they pad little). Distributions are computed at
    loss positions only; the other rows get zeros, as prompt rows do in features_from_generation. `base` may
    also be an ONNX Runtime runner of an artifact (clover.runtime.backends.graph.GraphRunner): one sequence per
    forward there."""
    forward = _teacher_forced if isinstance(base, Decoder) else _graph_teacher_forced
    taken = [0, 0]  # loss tokens of the sequences accepted so far (written or waiting in the window)
    pending: list[tuple[list[int], np.ndarray, bool]] = []

    def run(batch: list[tuple[list[int], np.ndarray, bool]]) -> None:
        forward(base, batch, writer)
        if progress:
            progress(writer.loss_tokens[0], budgets[0])

    def flush() -> None:
        pending.sort(key=lambda item: len(item[0]))
        batch: list[tuple[list[int], np.ndarray, bool]] = []
        for item in pending:
            if batch and (len(batch) + 1) * len(item[0]) > batch_tokens:
                run(batch)
                batch = []
            batch.append(item)
        if batch:
            run(batch)
        pending.clear()

    for ids, assistant, is_val in sequences:
        if taken[is_val] >= budgets[is_val] or len(ids) < 2:
            continue
        loss_mask = np.zeros(len(ids), dtype=np.bool_)
        loss_mask[:-1] = assistant[1:]
        taken[is_val] += int(loss_mask.sum())
        pending.append((ids, loss_mask, is_val))
        if len(pending) >= window:
            flush()
        if all(taken[v] >= budgets[v] for v in (0, 1)):
            break
    flush()


WINDOW = 64  # sequences sorted by length together before they are cut into batches (CPU default)
LM_HEAD_ROWS = 1024  # rows per LM-head matmul while building (bounds the [rows, V] logits in memory)


def build_sizes(device: torch.device) -> tuple[int, int]:
    """(batch_tokens, window) for teacher-forced feature batches: small on a CPU (memory, cache), large on a GPU,
    where a 135M base needs tens of thousands of tokens per forward to keep the device busy."""
    return (65536, 2048) if device.type == "cuda" else (8192, WINDOW)


def _teacher_forced(base: Decoder, batch: list[tuple[list[int], np.ndarray, bool]], writer) -> None:
    """One forward over `batch` (ids, loss mask, is_validation) on the base's device, handed to the writer whole."""
    dev = _device(base)
    k, B, L = writer.spec.topk, len(batch), max(len(ids) for ids, _, _ in batch)
    ids = torch.zeros(B, L, dtype=torch.long)  # [B, L], right-padded: causal rows never see the padding
    loss = torch.zeros(B, L, dtype=torch.bool)  # [B, L]
    for b, (x, m, _) in enumerate(batch):
        ids[b, : len(x)] = torch.tensor(x)
        loss[b, : len(x)] = torch.from_numpy(m)
    lengths = torch.tensor([len(x) for x, _, _ in batch])  # [B]
    ids, loss = ids.to(dev, non_blocking=True), loss.to(dev, non_blocking=True)
    keys, values = base.empty_cache(B, 0)
    out = base(
        ids,
        torch.arange(L, device=dev).expand(B, L),
        causal_mask(L, B, dev),
        torch.zeros(B, dtype=torch.long, device=dev),
        keys,
        values,
        logit_rows=torch.zeros(0, dtype=torch.long, device=dev),
    )
    rows = out.hidden_states[loss]  # [n, H]: the loss positions
    tk_ids = torch.zeros(B, L, k, dtype=torch.int32, device=dev)  # [B, L, K]
    tk_p = torch.zeros(B, L, k, dtype=torch.float16, device=dev)  # [B, L, K]
    step = LM_HEAD_ROWS if dev.type == "cpu" else 16 * LM_HEAD_ROWS
    parts = [_topk_tensors(base.logits(rows[i : i + step]), k) for i in range(0, len(rows), step)]
    if parts:
        tk_ids[loss] = torch.cat([p[0] for p in parts])
        tk_p[loss] = torch.cat([p[1] for p in parts])
    hidden = out.hidden_states.to(torch.float16)  # [B, L, H]
    hidden[torch.arange(B, device=dev), lengths.to(dev) - 1] = 0  # the last position has no next token
    writer.add_batch(ids, lengths, hidden, tk_ids, tk_p, loss, [v for _, _, v in batch])


def _graph_teacher_forced(runner, batch: list[tuple[list[int], np.ndarray, bool]], writer: FeatureWriter) -> None:
    """_teacher_forced on an artifact's base graph (the deployed one: its quantization included), a sequence a call."""
    k = writer.spec.topk
    for x, m, is_val in batch:
        rows = np.flatnonzero(m)
        hidden, logits = runner.teacher_forced(np.array(x), rows)  # [T, H], [n, V]
        tk_ids, tk_p = np.zeros((len(x), k), np.int32), np.zeros((len(x), k), np.float16)
        if len(rows):
            tk_ids[rows], tk_p[rows] = _topk(torch.from_numpy(logits), k)
        h = hidden.astype(np.float16)
        h[-1] = 0  # the last position has no next token: zero features
        writer.add(np.array(x), h, tk_ids, tk_p, m, is_val)


def _kept_length(prompt: int, response: int, max_length: int, answer_tokens: int) -> int:
    """Tokens of a corpus conversation a sequence keeps: prompt plus answer, cut to `max_length` and, if
    `answer_tokens`, to the answer's first `answer_tokens` tokens (computing no features for the rest)."""
    return min(prompt + (min(response, answer_tokens) if answer_tokens else response), max_length)


def _corpus_selection(corpus, spec: FeatureSpec) -> Iterator[tuple[int, Conversation, int, bool]]:
    """The corpus conversations a 'corpus' spec may use, in corpus order, as (shard index, conversation, kept
    length, is_validation): those whose prompt leaves room for an answer token, less the training ones that hold
    its first `skip_tokens` loss tokens. Validation is the corpus split's (by prompt index), whatever the seed."""
    validation = corpus.validation_indices()
    skipped = 0
    for s, entry in enumerate(corpus.provenance.shards):
        for c in corpus.read_shard(entry):
            P = len(c.prompt)
            if P + 1 >= spec.max_length:
                continue  # no response token would fit
            n = _kept_length(P, len(c.response), spec.max_length, spec.answer_tokens)
            is_val = c.index in validation
            if not is_val and skipped < spec.skip_tokens:
                skipped += n - P
                continue
            yield s, c, n, is_val


def corpus_sequences(corpus, spec: FeatureSpec) -> Iterator[tuple[list[int], list[bool], bool]]:
    """A clover.train.corpus folder's conversations as (ids, response mask, is_validation) in the corpus's order
    (_corpus_selection), each truncated to `spec.max_length` (and its answer to its first `spec.answer_tokens`)."""
    for _, c, n, is_val in _corpus_selection(corpus, spec):
        P = len(c.prompt)
        ids = np.concatenate((c.prompt, c.response))[:n]
        yield ids.tolist(), [False] * P + [True] * (n - P), is_val


def corpus_shards_used(corpus, spec: FeatureSpec) -> int:
    """How many of the corpus's shards a build of `spec` reads (features_from_dataset's budget rule on lengths
    alone), so a corpus that grows later keeps the same features."""
    budgets, taken, used = spec.budgets, [0, 0], 0
    for s, c, n, is_val in _corpus_selection(corpus, spec):
        if all(taken[v] >= budgets[v] for v in (0, 1)):
            return used
        if taken[is_val] < budgets[is_val]:
            taken[is_val] += n - len(c.prompt)
        used = s + 1
    return len(corpus.provenance.shards)


class _Slot:
    """One sequence being generated in the continuous batch."""

    def __init__(self, prompt: list[int], is_val: bool, hidden: np.ndarray, tk_ids: np.ndarray, tk_p: np.ndarray):
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.is_val = is_val
        self.hidden, self.tk_ids, self.tk_p = [hidden], [tk_ids], [tk_p]


@torch.inference_mode()
def features_from_generation(
    base: Decoder,
    prompts: Iterator[tuple[list[int], bool]],
    writer: FeatureWriter,
    budgets: tuple[int, int],
    eos_ids: tuple[int, ...],
    batch_size: int = 64,
    progress: Progress | None = None,
) -> None:
    """The base answers each prompt greedily (Medusa-2's self-distillation data); the features come
    from the same forward passes. Continuous batching: a finished sequence's row is refilled at once.

    Each row has its own past length (the decoder masks cache slots beyond it), so rows of different
    lengths decode together without padding tokens.
    """
    spec = writer.spec
    k, max_new = spec.topk, spec.max_new_tokens
    capacity = spec.max_length
    keys, values = base.empty_cache(batch_size, capacity)
    lengths = torch.zeros(batch_size, dtype=torch.long)  # cached tokens per row (host: read per row)
    current = torch.zeros(batch_size, dtype=torch.long)  # the token each row feeds next
    slots: list[_Slot | None] = [None] * batch_size
    exhausted = False

    def want(is_val: bool) -> bool:
        return writer.loss_tokens[is_val] < budgets[is_val]

    def finish(b: int) -> None:
        s = slots[b]
        writer.add(np.array(s.tokens), *_slot_features(s, k), s.is_val)
        slots[b] = None
        lengths[b], current[b] = 0, 0  # an idle row decodes a dummy token at slot 0 until refilled
        if progress:
            progress(writer.loss_tokens[0], budgets[0])

    while True:
        for b in range(batch_size):
            while slots[b] is None and not exhausted:
                picked = _next_prompt(prompts, want, capacity)
                if picked is None:
                    exhausted = True
                    break
                prompt, is_val = picked
                hidden, tk_ids, tk_p = _prefill_row(base, prompt, k, keys + values, b)
                slots[b] = _Slot(prompt, is_val, hidden, tk_ids, tk_p)
                first = int(tk_ids[-1, 0])
                slots[b].tokens.append(first)
                lengths[b], current[b] = len(prompt), first
                if first in eos_ids:
                    finish(b)
        active = [b for b in range(batch_size) if slots[b] is not None]
        if not active:
            break
        hidden, tk_ids, tk_p = _decode_step(base, (keys, values), lengths, current, k)
        for b in active:
            lengths[b] += 1
            s = slots[b]
            s.hidden.append(hidden[b : b + 1])
            s.tk_ids.append(tk_ids[b : b + 1])
            s.tk_p.append(tk_p[b : b + 1])
            nxt = int(tk_ids[b, 0])
            s.tokens.append(nxt)
            current[b] = nxt
            if nxt in eos_ids or len(s.tokens) - s.prompt_len >= max_new or len(s.tokens) >= capacity:
                finish(b)


def _next_prompt(prompts: Iterator[tuple[list[int], bool]], want, capacity: int) -> tuple[list[int], bool] | None:
    """The next prompt whose budget (`want`) is not met and that leaves room for 2 more tokens in the cache;
    None once both budgets are met or the prompts run out."""
    while want(False) or want(True):
        try:
            prompt, is_val = next(prompts)
        except StopIteration:
            return None
        if want(is_val) and len(prompt) + 2 <= capacity:
            return prompt, is_val
    return None


def _prefill_row(base: Decoder, prompt: list[int], k: int, caches: list[torch.Tensor], b: int):
    """Prefill `prompt` into row b of `caches` (keys then values): its hidden states and top-k (last row only)."""
    hidden, tk_ids, tk_p, new_k, new_v = prefill(base, prompt, k, last_only=True)
    for store, new in zip(caches, new_k + new_v):
        store[b, :, : len(prompt)] = new[0]
    return hidden, tk_ids, tk_p


def _decode_step(base: Decoder, cache, lengths: torch.Tensor, current: torch.Tensor, k: int):
    """Every row feeds its `current` token at slot `lengths` (its K/V written there into `cache`, the (keys,
    values) pair): each row's hidden state (fp16) and top-k. Idle rows decode a dummy token at slot 0."""
    keys, values = cache
    dev = _device(base)
    batch_size = len(lengths)
    P = int(lengths.max())  # the longest active row: idle rows are at 0
    on_dev = lengths.to(dev)
    out = base(
        current[:, None].to(dev),
        on_dev[:, None],
        torch.ones(batch_size, 1, 1, dtype=torch.bool, device=dev),
        on_dev,
        [kk[:, :, :P] for kk in keys],
        [vv[:, :, :P] for vv in values],
    )
    for store, new in zip(keys + values, out.new_keys + out.new_values):
        store[torch.arange(batch_size).to(dev), :, on_dev] = new[:, :, 0]
    hidden = out.hidden_states[:, 0].to(torch.float16).cpu().numpy()
    tk_ids, tk_p = _topk(out.logits[:, 0], k)
    return hidden, tk_ids, tk_p


def _slot_features(s: _Slot, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A finished sequence's hidden states, top-k and loss mask, one row per token."""
    n = len(s.tokens)
    hidden = np.concatenate(s.hidden)[:n]
    tk_ids, tk_p = np.concatenate(s.tk_ids)[:n], np.concatenate(s.tk_p)[:n]
    if hidden.shape[0] < n:  # the final token was never fed (EOS or length cap): no features of its own
        pad = n - hidden.shape[0]
        hidden = np.concatenate((hidden, np.zeros((pad, hidden.shape[1]), hidden.dtype)))
        tk_ids = np.concatenate((tk_ids, np.zeros((pad, k), tk_ids.dtype)))
        tk_p = np.concatenate((tk_p, np.zeros((pad, k), tk_p.dtype)))
    loss_mask = np.zeros(n, dtype=np.bool_)
    loss_mask[s.prompt_len - 1 : n - 1] = True  # p_t for t >= prompt_len - 1 predicts a generated token
    return hidden, tk_ids, tk_p, loss_mask


def prepare_features(
    base: Decoder,
    tokenizer,
    spec: FeatureSpec,
    root: Path,
    batch_size: int = 64,
    progress: Progress | None = None,
    teacher=None,
    in_memory: torch.device | None = None,
) -> FeatureCache | FeatureStore:
    """The cache for `spec` under `root`, built first if missing (the base model runs only here). `teacher`: the
    runner of spec.teacher's artifact (teacher-forced data only), which computes the features instead of `base`.
    `in_memory`: a FeatureStore on that device instead, read from the cache where one exists, else built on the
    base's device and never written to disk. Teacher-forced batches are sized for the base's device (build_sizes)."""
    from clover.train.data import first_turn_prompt, load_conversations, split, tokenize_conversation

    path = Path(root) / spec.key()
    if (path / "meta.json").is_file():
        cache = FeatureCache(path)
        return cache if in_memory is None else FeatureStore.from_cache(cache, in_memory)
    if spec.teacher and (teacher is None or spec.responses == "base"):
        raise CloverError(
            "features from an artifact's graph (--features-from) need teacher-forced data: a corpus "
            "(clover-data grow) or --responses dataset"
        )
    budgets = spec.budgets
    corpus = None
    if spec.responses == "corpus":
        corpus = open_corpus_for(spec)
    else:
        parts = split(load_conversations(spec.data), spec.seed, spec.validation_fraction)
    writer = (
        FeatureWriter(path, spec, base.config.hidden_size)
        if in_memory is None
        else MemoryWriter(spec, base.config.hidden_size, in_memory)
    )
    batch_tokens, window = build_sizes(_device(base))
    if spec.dtype != str(base.lm_head.weight.dtype).removeprefix("torch.") and not spec.teacher:
        import copy

        from clover.models.loading import parse_dtype

        base = copy.deepcopy(base).to(parse_dtype(spec.dtype))  # the caller's base keeps its precision
    try:
        if spec.responses == "base":
            max_prompt = spec.max_length - spec.max_new_tokens

            def prompts() -> Iterator[tuple[list[int], bool]]:
                for messages, is_val in interleave(parts.train, parts.validation):
                    ids = first_turn_prompt(tokenizer, messages)
                    if len(ids) <= max_prompt:
                        yield ids, is_val

            features_from_generation(base, prompts(), writer, budgets, tokenizer.eos_token_ids, batch_size, progress)
        elif spec.responses == "dataset":

            def sequences() -> Iterator[tuple[list[int], list[bool], bool]]:
                for messages, is_val in interleave(parts.train, parts.validation):
                    ids, mask = tokenize_conversation(tokenizer, messages, spec.max_length)
                    yield ids, mask, is_val

            features_from_dataset(teacher or base, sequences(), writer, budgets, progress, batch_tokens, window)
        elif spec.responses == "corpus":
            features_from_dataset(
                teacher or base, corpus_sequences(corpus, spec), writer, budgets, progress, batch_tokens, window
            )
        else:
            raise CloverError(f"unknown responses {spec.responses!r}: use 'base', 'dataset' or 'corpus'")
        if writer.loss_tokens[0] == 0 or writer.loss_tokens[1] == 0:
            raise CloverError(
                f"{spec.data} gave no usable {'training' if not writer.loss_tokens[0] else 'validation'} "
                "tokens: use more conversations or a larger --max-length"
            )
    except BaseException:
        writer.abort()
        raise
    return writer.finish({"base_architecture": base.config.architecture})


def open_corpus_for(spec: FeatureSpec):
    """The corpus a 'corpus' spec names, checked: made by this base, and its shards used still those named."""
    from clover.train.corpus import Corpus

    corpus = Corpus.open(spec.data)
    made_by = corpus.provenance.generator.base_fingerprint.get("lm_head_sha256")
    if made_by != spec.base_sha256:
        raise CloverError(
            f"corpus {spec.data} holds the answers of another base (LM head {made_by}; this base's is "
            f"{spec.base_sha256}): train with --base {corpus.provenance.generator.base}, or grow a corpus "
            "with this base's artifact"
        )
    used = corpus_shards_used(corpus, spec)
    if corpus.digest(used) != spec.corpus:
        raise CloverError(
            f"corpus {spec.data} changed while training started (its first {used} shards are not "
            "those the features are named for): run clover-train again"
        )
    return corpus
