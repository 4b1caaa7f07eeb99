"""ragspeed retrieval: ingestion, embeddings, FAISS and BM25 indexes, hybrid search, collections.

The gateway uses `CollectionStore` (collections on disk) and the frozen values `Document`,
`Hit`, `AddResult`, `CollectionStats`; errors map to HTTP statuses as `RetrievalError` -> 400,
`CollectionNotFound` -> 404 and `CorruptCollectionError` (a `RetrievalError`) -> refused.
Heavy dependencies (faiss, torch) load on first use of the classes that need them.
"""

from ragspeed.document import Document
from ragspeed.retrieval.config import IndexConfig, RetrievalConfig
from ragspeed.retrieval.documents import Hit
from ragspeed.retrieval.errors import CollectionNotFound, CorruptCollectionError, RetrievalError

__all__ = [
    "AddResult",
    "Collection",
    "CollectionNotFound",
    "CollectionStats",
    "CollectionStore",
    "CorruptCollectionError",
    "Document",
    "Hit",
    "IndexConfig",
    "RetrievalConfig",
    "RetrievalError",
    "SentenceTransformerEmbedder",
]

_LAZY = {
    "AddResult": "ragspeed.retrieval.collection",
    "Collection": "ragspeed.retrieval.collection",
    "CollectionStats": "ragspeed.retrieval.collection",
    "CollectionStore": "ragspeed.retrieval.store",
    "SentenceTransformerEmbedder": "ragspeed.retrieval.embedders",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'retrieval' has no attribute {name!r}")
