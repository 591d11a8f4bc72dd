"""Real dense retrieval over a passage pool: all-MiniLM-L6-v2 (``contextkit.synthesis.embed``) embeddings in a
faiss inner-product index.

The pool is every distinct passage of a multihop-shaped file; a passage's id is a hash of its title and
text, so the same passage keeps its id across questions, files and runs. Passage embeddings are cached
under ``<cache_dir>/embeddings/`` keyed by the pool's content hash and the embedder's version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contextkit.core.errors import InputError
from contextkit.synthesis.embed import EMBEDDER, Embedder, VectorIndex


@dataclass(frozen=True, slots=True)
class Passage:
    id: str
    title: str
    text: str


def passage_id(title: str, text: str) -> str:
    return hashlib.sha256(f"{title}\x00{text}".encode()).hexdigest()[:16]


def passage_pool(records) -> list[Passage]:
    """Distinct passages of ``records`` (``bench.data.QARecord``), in first-seen order."""
    seen: dict[str, Passage] = {}
    for r in records:
        for p in r.passages:
            pid = passage_id(p.title or "", p.text)
            if pid not in seen:
                seen[pid] = Passage(pid, p.title or "", p.text)
    if not seen:
        raise InputError("no passages to index; the data file has records without passages")
    return list(seen.values())


class Retriever:
    """Top-k passages for a query by cosine similarity of MiniLM embeddings (faiss ``IndexFlatIP``)."""

    def __init__(self, passages: list[Passage], cache_dir: Path, batch_size: int = 64):
        self.passages = passages
        self._embed = Embedder()
        digest = hashlib.sha256(
            json.dumps([EMBEDDER, [p.id for p in passages]]).encode()
        ).hexdigest()[:16]
        path = Path(cache_dir).expanduser() / "embeddings" / f"{EMBEDDER}-{digest}.npy"
        if path.is_file():
            vectors = np.load(path)
        else:
            texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in passages]
            vectors = self.embed(texts, batch_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, vectors)
            tmp.replace(path)  # atomic: a half-written file is never loaded
        self.index = VectorIndex(vectors)

    def embed(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return self._embed(texts, batch_size)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The top-``k`` passages for each query, best first."""
        _, idx = self.index.search(self.embed(queries), k)
        return [[self.passages[i] for i in row if i >= 0] for row in idx]
