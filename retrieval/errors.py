"""Errors the retrieval package raises; the gateway maps them to HTTP statuses.

- `RetrievalError(message, param)`: bad input (the gateway answers 400 and names `param`).
- `CollectionNotFound(name)`: an unknown collection (404).
- `CorruptCollectionError(path, reason)`: a collection file that failed its checks at load.
  It is refused, never served; a subclass of `RetrievalError` with `param="collection"`.
"""

from __future__ import annotations


class RetrievalError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class CollectionNotFound(KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
        self.message = f"collection {name!r} not found"

    def __str__(self) -> str:
        return self.message


class CorruptCollectionError(RetrievalError):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"refusing corrupt collection file {path}: {reason}", param="collection")
        self.path = path
        self.reason = reason
