"""Gateway-side retrieval: the collection store behind `/v1/collections` and `ragspeed.retrieval`.

The store (and the embedding model it needs) is built at start-up (`warm`) when the collections
folder holds a collection, so no request pays the load; a server without any collection builds
it when the first one is created, and one that never retrieves never loads the model. Store
calls are synchronous; routes run them in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt import Document
from ragspeed.gateway.protocol import RetrievalOptions
from ragspeed.gateway.settings import Settings

T = TypeVar("T")


class RetrievalService:
    def __init__(self, settings: Settings):
        self._settings = settings
        self._store: Any = None
        self._lock = threading.Lock()

    @property
    def store(self) -> Any:
        with self._lock:
            if self._store is None:
                from ragspeed.retrieval import CollectionStore, SentenceTransformerEmbedder

                embedder = SentenceTransformerEmbedder(self._settings.embedding_model)
                self._store = CollectionStore(self._settings.collections_dir, embedder)
            return self._store

    def warm(self) -> None:
        """Build the store now (the embedding model and every collection) if there is any
        collection to serve; thread-blocking, run it in a worker thread."""
        from ragspeed.retrieval.store import SUFFIX

        if any(Path(self._settings.collections_dir).glob(f"*{SUFFIX}")):
            self.store  # noqa: B018 -- the property builds it

    def call(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store method, mapping retrieval errors onto HTTP errors."""
        from ragspeed.retrieval.errors import CollectionNotFound, CorruptCollectionError, RetrievalError

        try:
            return method(*args, **kwargs)
        except CollectionNotFound as exc:
            raise APIError(404, str(exc), param="collection", code="collection_not_found") from None
        except CorruptCollectionError as exc:
            raise APIError(503, str(exc), param="collection", code="collection_corrupt") from None
        except RetrievalError as exc:
            raise APIError(
                400, getattr(exc, "message", str(exc)), param=getattr(exc, "param", None)
            ) from None

    def __call__(self, question: str, options: RetrievalOptions) -> list[Document]:
        """The pipeline's retrieval stage: the question's top hits as prompt documents."""
        if not question.strip():
            raise APIError(
                400, "retrieval needs a question (the last user message is empty)", param="messages"
            )
        hits = self.call(self.store.query, options.collection, question, options.top_k, options.mode)
        return [Document(id=h.document.id, text=h.document.text, title=h.document.title) for h in hits]
