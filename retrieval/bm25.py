"""Lexical retrieval with BM25 (bm25s, Lucene variant), over the same texts that are embedded.

Text is lower-cased, split on word characters, English stop words dropped and words reduced
to Porter stems (so "prizes" matches "prize"). bm25s has no incremental add, so the index is
rebuilt lazily, on the first search after a change; that is linear in the collection and fast
(~1 s per 100k short passages).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import bm25s
import numpy as np
from nltk.stem.porter import PorterStemmer

_PORTER = PorterStemmer()


@lru_cache(maxsize=200_000)
def _stem(word: str) -> str:
    return _PORTER.stem(word)


def tokenize(texts: Sequence[str]) -> list[list[str]]:
    tokens = bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)
    return [[_stem(word) for word in words] for words in tokens]


class BM25Index:
    def __init__(self) -> None:
        self._texts: dict[int, str] = {}  # label -> text
        self._retriever: bm25s.BM25 | None = None
        self._labels: np.ndarray = np.zeros(0, np.int64)  # [num_docs] bm25s position -> label

    @property
    def num_documents(self) -> int:
        return len(self._texts)

    def add(self, labels: Sequence[int], texts: Sequence[str]) -> None:
        self._texts.update(zip((int(x) for x in labels), texts))
        self._retriever = None

    def remove(self, labels: Sequence[int]) -> None:
        for label in labels:
            self._texts.pop(int(label), None)
        self._retriever = None

    def _ensure_built(self) -> None:
        if self._retriever is not None or not self._texts:
            return
        self._labels = np.fromiter(self._texts.keys(), dtype=np.int64, count=len(self._texts))
        retriever = bm25s.BM25()
        retriever.index(tokenize(list(self._texts.values())), show_progress=False)
        self._retriever = retriever

    def search(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, labels) of the documents sharing at least one term with the query, best
        first, at most k."""
        self._ensure_built()
        query_tokens = tokenize([query])[0]
        if self._retriever is None or not query_tokens:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        k = min(k, len(self._labels))
        positions, scores = self._retriever.retrieve([query_tokens], k=k, show_progress=False)
        positions, scores = positions[0], scores[0]  # [k]
        matched = scores > 0  # bm25s pads with zero-score documents
        return scores[matched].astype(np.float32), self._labels[positions[matched]]
