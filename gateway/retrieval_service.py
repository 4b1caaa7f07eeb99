"""Gateway-side retrieval: the collection store behind `/v1/collections` and `ragspeed.retrieval`.

The store, with the embedding model it needs and every persisted collection, is built at
start-up (`warm`, before the app reports ready), so no request pays the load; a server with
`enable_retrieval` off never loads the model and answers retrieval requests with a 400. Store
calls are synchronous; routes run them in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ragspeed.document import Document
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.protocol import RetrievalOptions
from ragspeed.gateway.settings import RetrievalSettings

T = TypeVar("T")


class RetrievalService:
    def __init__(self, settings: RetrievalSettings):
        self._settings = settings
        self._store: Any = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._settings.enabled

    @property
    def loaded(self) -> bool:
        """The embedding model and the collections are loaded."""
        return self._store is not None

    @property
    def store(self) -> Any:
        if not self.enabled:
            raise APIError(400, "retrieval is not enabled on this server (enable_retrieval)", param=None)
        with self._lock:
            if self._store is None:  # only before `warm` (the app warms before serving)
                from ragspeed.retrieval import CollectionStore, SentenceTransformerEmbedder

                embedder = SentenceTransformerEmbedder(self._settings.embedding_model)
                self._store = CollectionStore(self._settings.collections_dir, embedder)
            return self._store

    def warm(self) -> None:
        """Build the store now (the embedding model and every collection) when retrieval is
        enabled; thread-blocking, run it in a worker thread."""
        if self.enabled:
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
        """The pipeline's retrieval stage: the question's top hits' documents, metadata included."""
        if not question.strip():
            raise APIError(
                400, "retrieval needs a question (the last user message is empty)", param="messages"
            )
        hits = self.call(self.store.query, options.collection, question, options.top_k, options.mode)
        return [h.document for h in hits]
