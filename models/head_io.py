"""Head sets on disk: `heads.safetensors` + `heads.json`, and the `--heads` spec resolver.

heads.json records the architecture, sizes and the base the heads belong to (architecture, hidden
size, vocab size, LM-head hash) so that loading them on another base is a clear error, and the
artifact rebuilds the module from it alone (docs/design.md, Conventions 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from clover.atomic import publish_folder
from clover.errors import CloverError
from clover.models.clover import CloverHeads
from clover.models.clover2 import Clover2Heads
from clover.models.config import BaseConfig
from clover.models.decoder import Decoder
from clover.models.heads import ARCHITECTURES, BaseFingerprint, DraftHeads, HeadConfig
from clover.models.medusa import MedusaHeads

FORMAT_VERSION = 1
CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"
CLASSES: dict[str, type[DraftHeads]] = {"medusa": MedusaHeads, "clover": CloverHeads, "clover2": Clover2Heads}
# Sizes from the papers: Medusa 4 heads x 1 ResBlock; Clover 3 heads, 1-layer augmenting block;
# Clover-2 2-layer augmenting block (its recurrent head drafts any depth; 5 is the depth trained for).
DEFAULT_SIZES = {"medusa": (4, 1), "clover": (3, 1), "clover2": (5, 2)}


def build_heads(
    base: Decoder, arch: str, num_heads: int | None = None, num_layers: int | None = None, own_lm_head: bool = False
) -> DraftHeads:
    """A head set for `base` with uninitialised weights (call init_weights or load a state dict)."""
    if arch not in CLASSES:
        raise CloverError(f"unknown head architecture {arch!r}: use one of {', '.join(ARCHITECTURES)}")
    d_heads, d_layers = DEFAULT_SIZES[arch]
    cfg = HeadConfig(
        arch=arch,
        base=BaseFingerprint.of(base),
        base_config=base.config,
        num_heads=num_heads or d_heads,
        num_layers=num_layers or d_layers,
        own_lm_head=own_lm_head,
    )
    w = base.lm_head.weight
    return CLASSES[arch](cfg, base).to(device=w.device, dtype=w.dtype)


def random_heads(base: Decoder, arch: str, seed: int = 0) -> DraftHeads:
    """Untrained heads with the architecture's training-start initialisation (`random:ARCH[:SEED]`)."""
    heads = build_heads(base, arch)
    heads.init_weights(base, torch.Generator().manual_seed(seed))
    return heads.eval().requires_grad_(False)


def save_heads(heads: DraftHeads, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
    """Write heads.safetensors then heads.json into `path`, atomically (the folder appears whole).
    Other entries of an existing `path` (checkpoints, training.json) are kept."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-heads-", dir=path.parent))
    try:
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in heads.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE))
        cfg = dataclasses.asdict(heads.config)
        doc = {"format_version": FORMAT_VERSION, "dtype": str(dtype).removeprefix("torch."), **cfg}
        (tmp / CONFIG_FILE).write_text(json.dumps(doc, indent=1))
        # Anything else in an existing folder (training checkpoints, provenance) moves into the new one.
        carried = [e for e in path.iterdir() if e.name not in (WEIGHTS_FILE, CONFIG_FILE)] if path.is_dir() else []
        for entry in carried:
            os.replace(entry, tmp / entry.name)
        publish_folder(tmp, path)
    except BaseException:
        if tmp.exists() and path.is_dir():
            for entry in tmp.iterdir():
                if entry.name not in (WEIGHTS_FILE, CONFIG_FILE) and not (path / entry.name).exists():
                    os.replace(entry, path / entry.name)
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_head_config(path: str | Path) -> HeadConfig:
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise CloverError(f"{path} is not a head checkpoint: no {CONFIG_FILE} in it (make one with clover-train)")
    try:
        doc = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CloverError(f"{cfg_file} is not valid JSON ({e}): the checkpoint is corrupt, save it again") from e
    if doc.get("format_version") != FORMAT_VERSION:
        raise CloverError(
            f"{cfg_file} has format version {doc.get('format_version')}, this clover-deploy reads version "
            f"{FORMAT_VERSION}: re-save the heads with a matching clover-deploy"
        )
    try:
        base = dict(doc["base"], lm_head_probe=tuple(doc["base"].get("lm_head_probe", ())))
        return HeadConfig(
            arch=doc["arch"],
            base=BaseFingerprint(**base),
            base_config=BaseConfig.from_dict(doc["base_config"]),
            num_heads=doc["num_heads"],
            num_layers=doc["num_layers"],
            own_lm_head=doc.get("own_lm_head", False),
        )
    except (KeyError, TypeError) as e:
        raise CloverError(f"{cfg_file} is incomplete or malformed ({e!r}): save the heads again") from e


def load_heads(path: str | Path, base: Decoder) -> DraftHeads:
    path = Path(path)
    cfg = read_head_config(path)
    cfg.base.check(base, str(path))
    heads = build_heads(base, cfg.arch, cfg.num_heads, cfg.num_layers, cfg.own_lm_head)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CloverError(f"head checkpoint {path} has no {WEIGHTS_FILE}: the folder is incomplete, save it again")
    state = load_file(str(weights))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CloverError(
            f"{weights} does not match {cfg.arch} heads: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return heads.eval().requires_grad_(False)


# Trained heads shipped with the package, loadable by name (e.g. `--heads smollm2-clover2`).
PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"


def pretrained_names() -> list[str]:
    if not PRETRAINED_DIR.is_dir():
        return []
    return sorted(p.name for p in PRETRAINED_DIR.iterdir() if (p / CONFIG_FILE).is_file())


def heads_folder(spec: str) -> Path:
    """The folder of trained heads named by `spec`: a shipped name's, else the path itself."""
    return PRETRAINED_DIR / spec if spec in pretrained_names() else Path(spec)


def resolve_heads(spec: str, base: Decoder) -> DraftHeads | None:
    """`none` -> None (plain decoding); a shipped name (`smollm2-clover2`) -> trained heads;
    `random:ARCH[:SEED]` -> untrained heads; else a checkpoint folder."""
    if spec in ("none", ""):
        return None
    if spec in pretrained_names():
        return load_heads(PRETRAINED_DIR / spec, base)
    if spec.startswith("random:"):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[1] not in CLASSES or (len(parts) == 3 and not parts[2].isdecimal()):
            raise CloverError(
                f"bad heads spec {spec!r}: expected random:ARCH[:SEED] with ARCH one of {', '.join(ARCHITECTURES)}"
            )
        return random_heads(base, parts[1], int(parts[2]) if len(parts) == 3 else 0)
    if not Path(spec).is_dir():
        names = ", ".join(pretrained_names()) or "none shipped"
        raise CloverError(
            f"heads {spec!r} not found: pass a shipped name ({names}), a head checkpoint folder, "
            "random:ARCH[:SEED] or none"
        )
    return load_heads(spec, base)
