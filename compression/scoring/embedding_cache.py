"""A bounded LRU of embeddings keyed by content hash.

RAG corpora repeat: the same passages come back for many questions (nq_dev's 6,000 document
slots hold 1,247 distinct passages), so an embedding computed once is reused. The key is a hash
of the encoder's name and the exact text, so two encoders never share entries.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def content_key(namespace: str, text: str) -> bytes:
    return hashlib.blake2b(f"{namespace}\x00{text}".encode(), digest_size=16).digest()


class EmbeddingCache:
    def __init__(self, max_entries: int = 100_000):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> np.ndarray | None:
        vector = self._entries.get(key)
        if vector is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return vector

    def put(self, key: bytes, vector: np.ndarray) -> None:
        if self.max_entries == 0:
            return
        self._entries[key] = vector
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def encode_cached(
    namespace: str, texts: Sequence[str], cache: EmbeddingCache | None, encode_batch
) -> np.ndarray:
    """Embeddings of `texts` ([len(texts), dim]); only the misses go through `encode_batch`."""
    if cache is None:
        return encode_batch(list(texts))
    keys = [content_key(namespace, t) for t in texts]
    found = [cache.get(k) for k in keys]
    # Distinct missing texts, in first-seen order: duplicates are encoded once.
    missing: dict[str, bytes] = {}
    for text, key, vec in zip(texts, keys, found):
        if vec is None:
            missing.setdefault(text, key)
    if missing:
        fresh = encode_batch(list(missing))
        for key, vec in zip(missing.values(), fresh):
            cache.put(key, vec)
        by_text = dict(zip(missing, fresh))
        found = [by_text[t] if v is None else v for t, v in zip(texts, found)]
    vectors = [v for v in found if v is not None]  # every miss was filled above
    return np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32)
