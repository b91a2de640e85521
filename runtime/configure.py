"""From what a caller names to what runs: the backend's runner and tokenizer (`load_backend`), the tree it
speculates with (`choose_tree`), and the speculation an Engine or Generator drives (`Speculation`: the tree, the
draft source, the policy that picks each step's tree and sizes lookup drafts). numpy only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from clover.artifact import read_manifest
from clover.errors import CloverError
from clover.runtime.backend import Runner, RunnerInfo, RunnerSpec, backend_module
from clover.runtime.cost import VerifyCost, verify_cost
from clover.runtime.params import DraftSource, EngineOptions
from clover.runtime.policy import AutoTrees, DraftConfidence, FixedTrees, LookupLength
from clover.runtime.proposers import LOOKUP_DRAFTS, PLAIN, chain
from clover.runtime.tokenizer import Tokenizer, read_chat_template
from clover.runtime.tree import DynamicTree, Tree, default_tree, dynamic_tree, resolve_tree

LOOKUP_SUFFIX = "+lookup"  # heads "NAME+lookup": prompt-lookup drafts merged into the heads' tree
AUTO = "auto"  # tree "auto": each step, each sequence's tree sized by measured acceptance and verify cost


def choose_tree(info: RunnerInfo, tree: Tree | str | None, drafts: DraftSource | str) -> Tree:
    """The tree a runner speculates with, checked against its heads. drafts "lookup": a chain (default
    chain-12, LOOKUP_DRAFTS) capping the prompt-lookup drafts per step; "heads": `tree`, else the artifact's, else
    mc26."""
    if DraftSource.of(drafts) is DraftSource.LOOKUP:
        chosen = chain(LOOKUP_DRAFTS) if tree is None else resolve_tree(tree) if isinstance(tree, str) else tree
        if not chosen.is_chain:
            raise CloverError(
                f"prompt lookup drafts one continuation, but tree {chosen.name} branches: use "
                "chain-N (N = most drafted tokens per step)"
            )
        return chosen
    if info.heads is None:
        if tree not in (None, "plain") and not (isinstance(tree, Tree) and tree.num_nodes == 1):
            raise CloverError("a token tree needs draft heads: pass --heads (e.g. random:clover2) or --tree plain")
        return PLAIN
    if isinstance(tree, str) and (dynamic := dynamic_tree(tree, info.heads_max_depth)) is not None:
        # a chains-only base verifies dynamic chains: `dynamic` picks the chain's length each step
        tree = dataclasses.replace(dynamic, width=1) if info.chains_only and "-w" not in tree else dynamic
    chosen = (
        (info.default_tree or default_tree(info.heads_max_depth))
        if tree is None
        else (resolve_tree(tree) if isinstance(tree, str) else tree)
    )
    info.check_tree(chosen)
    if info.heads_max_depth is not None and chosen.max_depth > info.heads_max_depth:
        raise CloverError(
            f"tree {chosen.name} has depth {chosen.max_depth} but {info.heads} heads draft at most "
            f"{info.heads_max_depth} tokens: choose a shallower tree (e.g. chain-{info.heads_max_depth}) "
            "or heads with more depth (clover2 drafts any depth)"
        )
    return chosen


def with_cost(runner: Runner, tree: Tree | DynamicTree) -> Tree | DynamicTree:
    """A dynamic tree sized by this runner's verify-cost curve (measured here, once: one to a few seconds)."""
    if not isinstance(tree, DynamicTree) or tree.cost is not None:
        return tree
    return dataclasses.replace(
        tree,
        cost=verify_cost(runner, min(tree.budget + 1, runner.info.max_context - 40)).curve,
        confidence=tree.confidence or DraftConfidence(),
    )


def lookup_length(
    runner: Runner, tree_rows: int, drafts: DraftSource | str, cost: VerifyCost | None = None
) -> LookupLength | None:
    """For prompt-lookup drafts: what sizes their chains, on `cost` (default: this runner's verify-cost curve,
    measured once per runner, one to a few seconds); None for heads alone."""
    drafts = DraftSource.of(drafts)
    if not drafts.lookup:
        return None
    if cost is None:
        rows = tree_rows + (LOOKUP_DRAFTS if drafts is DraftSource.MERGED else 0)
        cost = verify_cost(runner, max(1, min(rows, runner.info.max_context - 40)))
    return LookupLength(cost.curve)


def auto_full_tree(info: RunnerInfo, drafts: DraftSource) -> Tree:
    """The deepest tree --tree auto may pick (it prunes it by depth down to plain): chain-4 for prompt lookup
    and chains-only graphs, else mc26 (pruned to the heads' depth); plain without heads."""
    if drafts is DraftSource.LOOKUP:
        return chain(max(LOOKUP_DRAFTS, 4))
    if info.heads is None:
        return chain(0)
    if info.chains_only:
        return chain(min(4, info.heads_max_depth or 4))
    return default_tree(info.heads_max_depth)


@dataclass
class Speculation:
    """What an Engine or Generator speculates with: the deepest `tree` a sequence may verify, where drafts come
    from, the policy that picks each step's tree (FixedTrees, or AutoTrees for tree "auto"), and what sizes
    lookup drafts (None without lookup)."""

    tree: Tree | DynamicTree
    drafts: DraftSource
    policy: FixedTrees | AutoTrees
    lookup_length: LookupLength | None

    @classmethod
    def build(
        cls,
        runner: Runner,
        tree: Tree | str | None,
        drafts: DraftSource | str,
        options: EngineOptions,
        log: IO | None = None,
    ) -> Speculation:
        """For tree "auto", the verify-cost curve covers the rows a step may run (a full batch of full trees and a
        prompt chunk): measured once per artifact, machine and batch setting, then read from the user cache."""
        drafts = DraftSource.of(drafts)
        if tree != AUTO:
            chosen = with_cost(runner, choose_tree(runner.info, tree, drafts))
            return cls(chosen, drafts, FixedTrees(), lookup_length(runner, chosen.num_nodes, drafts))
        full = auto_full_tree(runner.info, drafts)
        rows = options.max_batch * full.num_nodes + options.prefill_chunk
        cost = verify_cost(runner, max(1, min(runner.info.max_context - 40, rows)))
        if log is not None:
            print(
                f"tree auto: plain up to {full.name}; verify cost {cost.source}: "
                + ", ".join(f"{r} rows {m:.1f} ms" for r, m in cost.to_dict()["rows_ms"].items()),
                file=log,
            )
        return cls(full, drafts, AutoTrees(full, cost), lookup_length(runner, full.num_nodes, drafts, cost))

    @property
    def tree_name(self) -> str:
        return AUTO if isinstance(self.policy, AutoTrees) else self.tree.name

    def label(self, info: RunnerInfo) -> str:
        """What drafted, for results and reports: lookup, the heads' name, or NAME+lookup."""
        if self.drafts is DraftSource.LOOKUP:
            return "lookup"
        return info.heads_name + (LOOKUP_SUFFIX if self.drafts is DraftSource.MERGED else "")


def load_backend(
    base: str | Path, heads: str | None, backend: str, options: EngineOptions, default_drafts: bool = True
) -> tuple[Runner, Tokenizer, DraftSource]:
    """The backend's runner, the base's tokenizer and the draft source, from CLI-style specs (Generator.load,
    Engine.load): heads "lookup" is prompt lookup on the base alone, "NAME+lookup" (or "+lookup" for the
    backend's default heads) adds its drafts to the heads' tree; heads left None take the backend's defaults;
    options.threads reaches the torch and ort backends, options.providers the ort backend, options.max_batch > 1
    the ort backend's batched base graph where the artifact has one, options.chat_template the tokenizer (replacing
    the model's template, or adding one). default_drafts: heads left None on an artifact take its manifest's
    `drafts` (timed at export); False (the caller named a tree for the heads): its heads."""
    if options.device is not None and backend != "torch":
        raise CloverError(
            f"--device places the torch backend's model: use it with --backend torch, not {backend} (ONNX Runtime "
            "takes --providers cuda)"
        )
    module = backend_module(backend)
    if heads is None and default_drafts and backend in ("ort", "trt"):  # the artifact's default, timed at export
        heads = {"lookup": "lookup", "heads+lookup": LOOKUP_SUFFIX}.get(read_manifest(base).drafts)
    drafts = DraftSource.LOOKUP if heads == "lookup" else DraftSource.HEADS
    heads = "none" if drafts is DraftSource.LOOKUP else heads
    if heads is not None and heads.endswith(LOOKUP_SUFFIX):  # NAME+lookup, or +lookup: the default heads
        drafts, heads = DraftSource.MERGED, heads.removesuffix(LOOKUP_SUFFIX) or None
    if options.providers is not None and backend != "ort":
        raise CloverError(
            f"--providers chooses ONNX Runtime's execution providers: use it with --backend ort, not {backend}"
        )
    spec = RunnerSpec(
        heads=heads,
        dtype=options.dtype,
        threads=options.threads if backend in ("torch", "ort") else None,
        batch=backend == "ort" and options.max_batch > 1,  # the artifact's batched base graph, if any
        device=options.device,
        providers=options.providers,
    )
    # read before the runner: a bad template fails before minutes of loading
    template = read_chat_template(options.chat_template) if options.chat_template is not None else None
    runner, tokenizer = module.from_spec(base, spec), Tokenizer.from_dir(module.base_dir(base))
    return runner, tokenizer if template is None else tokenizer.with_chat_template(template), drafts
