"""A collection: documents, their dense index and their BM25 index, searched by mode.

Each document gets an int64 *label*, the key in both indexes (FAISS needs integers; document
ids are strings). Labels are never reused, so a stale label can only miss, never point at the
wrong document.

Query modes (registry `SEARCH_MODES`): `dense` (embedding inner product), `bm25` (lexical) and
`hybrid` (both, fused by reciprocal rank fusion over `fusion_depth` candidates from each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragspeed.document import Document
from ragspeed.retrieval.bm25 import BM25Index
from ragspeed.retrieval.config import QUERY_MODES, RetrievalConfig
from ragspeed.retrieval.documents import Hit, content_key, embedding_text
from ragspeed.retrieval.embedders import Embedder
from ragspeed.retrieval.errors import RetrievalError
from ragspeed.retrieval.faiss_index import VectorIndex
from ragspeed.retrieval.fusion import reciprocal_rank_fusion
from ragspeed.retrieval.ingest import drop_duplicates

MAX_TOP_K = 1000


@dataclass(frozen=True)
class AddResult:
    num_added: int
    num_duplicates: int
    ids: tuple[str, ...]  # ids of the documents added, in order


@dataclass(frozen=True)
class CollectionStats:
    name: str
    num_documents: int
    dim: int
    embedder: str
    index_kind: str  # "empty" | "flat" | "ivf" | "hnsw"
    index_device: str
    nprobe: int  # IVF cells scanned per query; 0 for other kinds


def _dense(collection: Collection, query: str, depth: int) -> list[tuple[int, float]]:
    vector = collection.embedder.embed([query])  # [1, dim]
    scores, labels = collection.vectors.search(vector, depth)
    return [(int(label), float(score)) for label, score in zip(labels[0], scores[0]) if label >= 0]


def _bm25(collection: Collection, query: str, depth: int) -> list[tuple[int, float]]:
    scores, labels = collection.bm25.search(query, depth)
    return [(int(label), float(score)) for label, score in zip(labels, scores)]


def _hybrid(collection: Collection, query: str, depth: int) -> list[tuple[int, float]]:
    config = collection.config
    fusion_depth = max(config.fusion_min_depth, config.fusion_depth_factor * depth)
    rankings = [[label for label, _ in search(collection, query, fusion_depth)] for search in (_dense, _bm25)]
    weights = (config.dense_weight, config.bm25_weight)
    return reciprocal_rank_fusion(rankings, k=config.rrf_k, weights=weights)[:depth]


SEARCH_MODES: dict[str, Callable[[Collection, str, int], list[tuple[int, float]]]] = {
    "dense": _dense,
    "bm25": _bm25,
    "hybrid": _hybrid,
}
assert set(SEARCH_MODES) == set(QUERY_MODES)


class Collection:
    def __init__(self, name: str, embedder: Embedder, config: RetrievalConfig) -> None:
        self.name = name
        self.embedder = embedder
        self.config = config
        self.vectors = VectorIndex(embedder.dim, config.index)
        self.bm25 = BM25Index()
        self._documents: dict[int, Document] = {}  # label -> document
        self._labels: dict[str, int] = {}  # document id -> label
        self._content_keys: set[str] = set()
        self._next_label = 0

    def __len__(self) -> int:
        return len(self._documents)

    def documents(self) -> list[Document]:
        return list(self._documents.values())

    def add(self, documents: Sequence[Document], vectors: np.ndarray | None = None) -> AddResult:
        """Add documents (duplicates of present ones, by id or content, are dropped). `vectors`
        ([len(documents), dim], normalised) skips embedding when the caller has them."""
        if vectors is not None and len(vectors) != len(documents):
            raise RetrievalError(f"{len(vectors)} vectors for {len(documents)} documents", "vectors")
        position = {id(doc): i for i, doc in enumerate(documents)}
        kept, num_duplicates = drop_duplicates(documents, set(self._labels), set(self._content_keys))
        if not kept:
            return AddResult(0, num_duplicates, ())
        if vectors is None:
            vectors = self.embedder.embed([embedding_text(doc) for doc in kept])  # [num_kept, dim]
        else:
            vectors = np.asarray(vectors, dtype=np.float32)[[position[id(doc)] for doc in kept]]
        labels = np.arange(self._next_label, self._next_label + len(kept), dtype=np.int64)
        self.vectors.add(labels, vectors)
        self.bm25.add(labels.tolist(), [embedding_text(doc) for doc in kept])
        for label, doc in zip(labels.tolist(), kept):
            self._documents[label] = doc
            self._labels[doc.id] = label
            self._content_keys.add(content_key(doc.text))
        self._next_label += len(kept)
        return AddResult(len(kept), num_duplicates, tuple(doc.id for doc in kept))

    def delete(self, ids: Sequence[str]) -> int:
        """Remove documents by id; unknown ids are ignored. Returns how many were removed."""
        labels = [self._labels[doc_id] for doc_id in dict.fromkeys(ids) if doc_id in self._labels]
        if not labels:
            return 0
        self.vectors.remove(np.array(labels, dtype=np.int64))
        self.bm25.remove(labels)
        for label in labels:
            doc = self._documents.pop(label)
            del self._labels[doc.id]
            self._content_keys.discard(content_key(doc.text))
        return len(labels)

    def query(self, text: str, top_k: int = 5, mode: str | None = None) -> list[Hit]:
        mode = mode or self.config.default_mode
        search = SEARCH_MODES.get(mode)
        if search is None:
            raise RetrievalError(f"mode must be one of {sorted(SEARCH_MODES)}, got {mode!r}", "mode")
        if not isinstance(text, str) or not text.strip():
            raise RetrievalError("query text must be a non-empty string", "query")
        if not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K:
            raise RetrievalError(f"top_k must be an integer in [1, {MAX_TOP_K}], got {top_k!r}", "top_k")
        if not self._documents:
            return []
        hits: list[Hit] = []
        for label, score in search(self, text, top_k):
            doc = self._documents.get(label)
            if doc is not None:  # a label deleted since the search began is skipped
                hits.append(Hit(document=doc, score=score, rank=len(hits) + 1))
        return hits

    def stats(self) -> CollectionStats:
        return CollectionStats(
            name=self.name,
            num_documents=len(self._documents),
            dim=self.embedder.dim,
            embedder=self.embedder.name,
            index_kind=self.vectors.kind,
            index_device=self.vectors.device,
            nprobe=self.vectors.nprobe,
        )

    # ---- persistence (the file format is persistence.py's) ----------------------------
    def to_state(self) -> tuple[dict[str, Any], bytes]:
        index_state, index_bytes = self.vectors.to_state()
        meta = {
            "name": self.name,
            "embedder": self.embedder.name,
            "dim": self.embedder.dim,
            "next_label": self._next_label,
            "documents": [[label, doc.to_json()] for label, doc in self._documents.items()],
            "index": index_state,
        }
        return meta, index_bytes

    @classmethod
    def from_state(
        cls, meta: dict[str, Any], index_bytes: bytes, embedder: Embedder, config: RetrievalConfig
    ) -> Collection:
        """Rebuild a collection; raises ValueError/KeyError/RuntimeError on inconsistent state."""
        if int(meta["dim"]) != embedder.dim:
            raise ValueError(
                f"collection vectors are {meta['dim']}-d, embedder {embedder.name!r} gives {embedder.dim}-d"
            )
        collection = cls(meta["name"], embedder, config)
        collection.vectors = VectorIndex.from_state(embedder.dim, config.index, meta["index"], index_bytes)
        for label, doc_json in meta["documents"]:
            doc = Document.from_json(doc_json)
            collection._documents[int(label)] = doc
            collection._labels[doc.id] = int(label)
            collection._content_keys.add(content_key(doc.text))
        collection._next_label = int(meta["next_label"])
        if collection.vectors.num_vectors != len(collection._documents):
            raise ValueError(
                f"index holds {collection.vectors.num_vectors} vectors for {len(collection._documents)} documents"
            )
        collection.bm25.add(
            list(collection._documents), [embedding_text(d) for d in collection._documents.values()]
        )
        return collection
