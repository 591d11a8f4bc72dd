"""Cache-aware evidence ordering: permute the retrieved set so its prefix is the most reusable.

``Weaver.order`` walks the tenant's prefix tree greedily: from the root it follows the child (among the
retrieved documents) with the most reusable tokens, then appends the remaining documents in retrieval
order (the retriever's ranking is the best remaining signal, and keeping it makes the unmatched tail
identical across repeats of the same retrieval, which seeds the next reuse). It then records the served
order in the tree (or leaves that to ``record``). The evidence set never changes, only its order.

Reusable tokens are counted the way the engine reuses them: in whole blocks (vLLM hashes KV in blocks
of ``block_size`` tokens; a partial block at a document boundary is recomputed).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.planner import MAX_DOCUMENTS as MAX_K
from contextkit.core.planner import MAX_ID_CHARS
from contextkit.core.tenant import MAX_SUB_TENANTS, Tenant
from contextkit.core.tenant_lru import TenantLRU
from contextkit.core.types import Doc, OrderResult
from contextkit.ordering.tree import PrefixTree


def reusable(tree: PrefixTree, docs: Sequence[Doc], block_size: int) -> tuple[int, int]:
    """(reusable tokens in whole blocks, matched docs) of serving ``docs`` in this order."""
    total = matched = 0
    for node, doc in zip(tree.walk(d.id for d in docs), docs):
        if node.tokens != doc.tokens:
            break
        total += node.tokens
        matched += 1
    return total - total % block_size if block_size > 1 else total, matched


def _check(docs: Sequence[Doc]) -> None:
    if len(docs) > MAX_K:
        raise InputError(f"{len(docs)} documents in one request; at most {MAX_K} are accepted")
    seen = set()
    for d in docs:
        if len(d.id) > MAX_ID_CHARS:
            raise InputError(f"document id {d.id[:40]!r}... is over {MAX_ID_CHARS} characters")
        if d.id in seen:
            raise InputError(f"document id {d.id!r} appears twice in one request; deduplicate the evidence")
        if d.tokens < 0:
            raise InputError(f"document {d.id!r} has a negative token length")
        seen.add(d.id)


class Weaver:
    """Orders evidence per tenant; safe to call from many threads.

    Args:
        block_size: the engine's KV block size (vLLM: 16 on GPU, 32 on CPU).
        max_nodes: bound of each tenant's tree.
        max_tenants: trees kept; past it the least recently used tenant's tree is dropped (its
            history is a model of cache contents the engine will have evicted by then anyway).
        max_trees_per_key: trees of one key tenant (its own and its sub-tenants', ``Tenant.key_tenant``)
            kept; past it that key's least recently used tree is dropped, so a key inventing
            sub-tenants drops its own history, never another key's.

    Memory is bounded: ``max_tenants`` trees of ``max_nodes`` nodes, each node an id of at most
    ``MAX_ID_CHARS`` characters. Only ``record`` creates a tree; asking for an order (``record=False``)
    for an unknown tenant creates nothing.
    """

    def __init__(self, block_size: int = 16, max_nodes: int = 100_000, max_tenants: int = 1024,
                 max_trees_per_key: int = MAX_SUB_TENANTS + 1):
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if max_tenants < 1:
            raise ConfigError(f"max_tenants must be >= 1, got {max_tenants}")
        if max_trees_per_key < 1:
            raise ConfigError(f"max_trees_per_key must be >= 1, got {max_trees_per_key}")
        self.block_size = block_size
        self.max_nodes = max_nodes
        self.max_tenants = max_tenants
        self.max_trees_per_key = max_trees_per_key
        self._trees: TenantLRU[str, PrefixTree] = TenantLRU(max_tenants, max_trees_per_key, lambda name: name)
        self._lock = threading.Lock()

    def tree(self, tenant: Tenant | str = "", create: bool = True) -> PrefixTree:
        """The tenant's tree (an unknown tenant starts with an empty one and learns nothing from others;
        with ``create=False`` that empty tree is not kept)."""
        name = Tenant.of(tenant).name
        with self._lock:
            tree = self._trees.get(name)
            if tree is None:
                tree = PrefixTree(self.max_nodes)
                if create:
                    self._trees[name] = tree  # the newest; drops the oldest of its key, or of all, past a bound
                return tree
            self._trees.touch(name)
            return tree

    @property
    def tenants(self) -> int:
        return len(self._trees)

    def record(self, docs: Sequence[Doc], tenant: Tenant | str = "") -> None:
        """``docs`` were served in this order to an engine: its prefix cache now holds them."""
        _check(docs)
        tree = self.tree(tenant)
        if docs:
            with self._lock:
                tree.insert((d.id, d.tokens) for d in docs)

    def order(self, docs: Sequence[Doc], tenant: Tenant | str = "", record: bool = True) -> OrderResult:
        """The most reusable order of ``docs`` for ``tenant``; records it as served unless ``record=False``
        (the planner asks without recording and the caller records once the engine accepted the request).

        Empty evidence is valid and returns an empty order.
        """
        t0 = time.perf_counter()
        _check(docs)
        tree = self.tree(tenant, create=record)
        with self._lock:
            picked: list[int] = []
            node = tree.root
            while True:  # greedy: heaviest matching child, ties to the most recently used
                best = None  # look up the k retrieved ids among the node's children: O(k) per level
                for i, d in enumerate(docs):
                    child = node.children.get(d.id)
                    if child is None or child.tokens != d.tokens or i in picked:
                        continue
                    if best is None or (child.tokens, child.last_used) > (best[1].tokens, best[1].last_used):
                        best = (i, child)
                if best is None:
                    break
                picked.append(best[0])
                node = best[1]
            chosen = set(picked)
            rest = [i for i in range(len(docs)) if i not in chosen]
            order = tuple(picked + rest)
            served = [docs[i] for i in order]
            tokens, matched = reusable(tree, served, self.block_size)
            if record and docs:
                tree.insert((d.id, d.tokens) for d in served)
        return OrderResult(order, tokens, matched, (time.perf_counter() - t0) * 1e6)


def oracle(tree: PrefixTree, docs: Sequence[Doc], block_size: int = 16) -> tuple[tuple[int, ...], int]:
    """The order with the most reusable tokens, and that count. Exhaustive over permutations for
    k <= 8 (the evaluation reference); for larger k an exact search over the tree's matching paths
    (the best order is the heaviest root path using only retrieved documents, then the rest)."""
    _check(docs)
    if len(docs) <= 8:
        best: tuple[tuple[int, ...], int] = (tuple(range(len(docs))), -1)
        for perm in itertools.permutations(range(len(docs))):
            tokens, _ = reusable(tree, [docs[i] for i in perm], block_size)
            if tokens > best[1]:
                best = (perm, tokens)
        return best[0], max(best[1], 0)
    return search(tree, docs, block_size)


def search(tree: PrefixTree, docs: Sequence[Doc], block_size: int = 16) -> tuple[tuple[int, ...], int]:
    """Exact best order by depth-first search over the tree paths that use only retrieved documents."""
    best_path: list[int] = []
    best_tokens = 0
    stack: list[tuple] = [(tree.root, [], 0)]
    while stack:
        node, path, tokens = stack.pop()
        whole = tokens - tokens % block_size if block_size > 1 else tokens
        if whole > best_tokens:
            best_path, best_tokens = path, whole
        for i, d in enumerate(docs):
            child = node.children.get(d.id)
            if child is not None and i not in path and child.tokens == d.tokens:
                stack.append((child, path + [i], tokens + child.tokens))
    rest = [i for i in range(len(docs)) if i not in best_path]
    return tuple(best_path + rest), best_tokens
