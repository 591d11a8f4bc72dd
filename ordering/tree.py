"""A prefix tree over recently served evidence sequences (CacheWeaver's data structure).

Each path from the root is a sequence of documents some request was served with, in the order it was
served; each node is one document with its token length. A prefix-caching engine (vLLM, SGLang) holds
KV for exactly such prefixes, so the tree is a model of what the engine can still reuse. It is bounded
(``max_nodes``) and forgets least-recently-used leaves first: old sequences decay out as the engine's
cache would evict them. Not thread-safe by itself; ``ordering.weaver.Weaver`` locks around it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from contextkit.core.errors import ConfigError


@dataclass(eq=False)
class Node:
    doc_id: str
    tokens: int
    parent: Node | None
    children: dict[str, Node] = field(default_factory=dict)
    last_used: int = 0
    hits: int = 0

    def path(self) -> list[str]:
        out, node = [], self
        while node.parent is not None:
            out.append(node.doc_id)
            node = node.parent
        return out[::-1]


class PrefixTree:
    """Served document sequences, bounded to ``max_nodes`` nodes (root excluded)."""

    def __init__(self, max_nodes: int = 100_000):
        if max_nodes < 1:
            raise ConfigError(f"max_nodes must be >= 1, got {max_nodes}")
        self.max_nodes = max_nodes
        self.root = Node("", 0, None)
        self.size = 0
        self.clock = 0  # logical time: one tick per recorded sequence

    def insert(self, docs: Iterable[tuple[str, int]]) -> None:
        """Record a served sequence of (doc_id, tokens); refreshes the recency of its whole path."""
        self.clock += 1
        node = self.root
        for doc_id, tokens in docs:
            child = node.children.get(doc_id)
            if child is None or child.tokens != tokens:  # a changed document is a different prefix
                child = Node(doc_id, tokens, node)
                node.children[doc_id] = child
                self.size += 1
            child.last_used = self.clock
            child.hits += 1
            node = child
        self._evict()

    def walk(self, docs: Iterable[str]) -> Iterator[Node]:
        """The nodes matched by a sequence of doc ids, from the root, until the first miss."""
        node = self.root
        for doc_id in docs:
            node = node.children.get(doc_id)  # type: ignore[assignment]
            if node is None:
                return
            yield node

    def _evict(self) -> None:
        """Over the bound: drop LRU leaves down to 90% of it (batched, so the scan is amortised)."""
        if self.size <= self.max_nodes:
            return
        target = int(self.max_nodes * 0.9)
        # least recently used leaves first; a parent becomes a leaf when its last child goes
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.size > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.doc_id]
            self.size -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
