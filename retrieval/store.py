"""`CollectionStore`: named collections on disk, the service the gateway routes and the CLI use.

Each collection lives in `<root_dir>/<name>.ragcoll` (see persistence.py). All collections are
loaded when the store is made; a file that fails its checks is refused (never served): asking
for that collection raises its `CorruptCollectionError`. Every change is saved before the
method returns. Methods are synchronous and serialised by one lock (searches take
milliseconds); the gateway calls them from a worker thread.
"""

from __future__ import annotations

import builtins
import json
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from ragspeed.document import Document
from ragspeed.retrieval.collection import AddResult, Collection, CollectionStats
from ragspeed.retrieval.config import RetrievalConfig
from ragspeed.retrieval.documents import Hit, document_id
from ragspeed.retrieval.embedders import Embedder
from ragspeed.retrieval.errors import CollectionNotFound, CorruptCollectionError, RetrievalError
from ragspeed.retrieval.ingest import IngestReport, SourceRecord, documents_from_records, ingest_paths
from ragspeed.retrieval.persistence import load_collection_file, save_collection_file

logger = logging.getLogger(__name__)

SUFFIX = ".ragcoll"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise RetrievalError(
            "collection name must be 1-64 letters, digits, '_', '.' or '-', starting with a letter"
            f" or digit; got {name!r}",
            "collection",
        )
    return name


class CollectionStore:
    def __init__(
        self, root_dir: str | Path, embedder: Embedder, config: RetrievalConfig | None = None
    ) -> None:
        self.root_dir = Path(root_dir)
        self.embedder = embedder
        self.config = config or RetrievalConfig()
        self._lock = threading.RLock()
        self._collections: dict[str, Collection] = {}
        self._refused: dict[str, RetrievalError] = {}  # name -> why its file was refused
        self.root_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.root_dir.glob(f"*{SUFFIX}")):
            self._load(path)

    def _path(self, name: str) -> Path:
        return self.root_dir / f"{name}{SUFFIX}"

    def _load(self, path: Path) -> None:
        name = path.name[: -len(SUFFIX)]
        try:
            meta, index_bytes = load_collection_file(path)
            try:
                collection = Collection.from_state(meta, index_bytes, self.embedder, self.config)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise CorruptCollectionError(str(path), f"inconsistent contents ({exc})") from exc
        except CorruptCollectionError as exc:
            logger.error("%s", exc.message)
            self._refused[name] = exc
            return
        if meta.get("embedder") != self.embedder.name:
            logger.warning(
                "collection %r was built with %r, now queried with %r",
                name,
                meta.get("embedder"),
                self.embedder.name,
            )
        self._collections[name] = collection

    def _save(self, collection: Collection) -> None:
        meta, index_bytes = collection.to_state()
        save_collection_file(self._path(collection.name), meta, index_bytes)

    # ---- collections --------------------------------------------------------------------
    def get(self, name: str) -> Collection:
        with self._lock:
            collection = self._collections.get(name)
            if collection is not None:
                return collection
            if name in self._refused:
                raise self._refused[name]
            raise CollectionNotFound(name)

    def create(self, name: str, *, exist_ok: bool = False) -> CollectionStats:
        check_name(name)
        with self._lock:
            if name in self._collections or name in self._refused:
                if exist_ok and name in self._collections:
                    return self._collections[name].stats()
                raise RetrievalError(f"collection {name!r} already exists", "collection")
            collection = Collection(name, self.embedder, self.config)
            self._save(collection)
            self._collections[name] = collection
            return collection.stats()

    def list(self) -> list[CollectionStats]:
        with self._lock:
            return [self._collections[name].stats() for name in sorted(self._collections)]

    def refused(self) -> dict[str, str]:
        """Collections whose files were refused at load, with the reason."""
        with self._lock:
            return {name: exc.message for name, exc in self._refused.items()}

    def delete(self, name: str) -> None:
        """Delete a collection and its file (a refused file too)."""
        with self._lock:
            if name not in self._collections and name not in self._refused:
                raise CollectionNotFound(name)
            self._path(name).unlink(missing_ok=True)
            self._collections.pop(name, None)
            self._refused.pop(name, None)

    def stats(self, name: str) -> CollectionStats:
        return self.get(name).stats()

    # ---- documents ----------------------------------------------------------------------
    def add_documents(self, name: str, documents: Sequence[Document], *, chunk: bool = True) -> AddResult:
        """Add documents; with `chunk`, texts longer than `chunk_tokens` are split and their
        chunks get ids `<id>#<i>`. A document with an empty id gets a content-hash id."""
        if isinstance(documents, (str, bytes)) or not all(isinstance(d, Document) for d in documents):
            raise RetrievalError("documents must be a list of Document", "documents")
        for i, doc in enumerate(documents):
            if not isinstance(doc.text, str) or not doc.text.strip():
                raise RetrievalError(
                    f"documents[{i}].text must be a non-empty string", f"documents[{i}].text"
                )
            try:
                json.dumps(doc.metadata)
            except (TypeError, ValueError) as exc:
                raise RetrievalError(
                    f"documents[{i}].metadata must be JSON-serialisable ({exc})", f"documents[{i}].metadata"
                ) from exc
        if chunk:
            records = [
                SourceRecord(
                    source=f"collection:{name}",
                    text=d.text,
                    title=d.title,
                    given_id=d.id or None,
                    metadata=d.metadata,
                )
                for d in documents
            ]
            documents = documents_from_records(
                records, self.embedder.tokenizer, self.config.chunk_tokens, self.config.chunk_overlap_tokens
            )
        else:
            source = f"collection:{name}"
            documents = [d if d.id else replace(d, id=document_id(source, d.text)) for d in documents]
        with self._lock:
            collection = self.get(name)
            result = collection.add(documents)
            if result.num_added:
                self._save(collection)
            return result

    def add_files(self, name: str, paths: Iterable[str | Path]) -> tuple[AddResult, IngestReport]:
        report = ingest_paths(
            paths, self.embedder.tokenizer, self.config.chunk_tokens, self.config.chunk_overlap_tokens
        )
        for message in report.skipped:
            logger.warning("%s", message)
        with self._lock:
            collection = self.get(name)
            result = collection.add(report.documents)
            if result.num_added:
                self._save(collection)
        return AddResult(result.num_added, result.num_duplicates + report.num_duplicates, result.ids), report

    def delete_ids(self, name: str, ids: Sequence[str]) -> int:
        if isinstance(ids, str) or not all(isinstance(x, str) for x in ids):
            raise RetrievalError("ids must be a list of strings", "ids")
        with self._lock:
            collection = self.get(name)
            removed = collection.delete(ids)
            if removed:
                self._save(collection)
            return removed

    def query(
        self, name: str, text: str, top_k: int = 5, mode: str | None = None
    ) -> builtins.list[Hit]:  # `list` here is the method above
        with self._lock:
            return self.get(name).query(text, top_k, mode)
