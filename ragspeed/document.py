"""The document: one frozen value from the request to the prompt, shared by gateway, compression
and retrieval.

A *document* is one passage the answer may draw on: a record the caller sent with the request, a
chunk retrieved from a collection, or what compression kept of either (the same document with a
shorter `text`). Its fields:

- `id`: stable; the caller's, or a content hash given where the document enters.
- `text`: what is rendered, compressed and counted.
- `title`: rendered before the text; never compressed and not counted as document tokens.
- `metadata`: the caller's, free-form and JSON-serialisable, carried through untouched; treat it
  as read-only. It is not part of the hash (a dict is not hashable).
- `protected`: compression keeps the document whole (its tokens still count against a target).

It sits at the top of the namespace, in no package, so that compression and retrieval share it
without importing each other; the gateway converts its wire model to it once, at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    protected: bool = False

    def __post_init__(self) -> None:
        for name in ("id", "text", "title"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Document.{name} must be a string, not {type(value).__name__}")
        if not isinstance(self.metadata, dict):
            raise TypeError(f"Document.metadata must be a dict, not {type(self.metadata).__name__}")
        if not isinstance(self.protected, bool):
            raise TypeError(f"Document.protected must be a bool, not {type(self.protected).__name__}")

    def to_json(self) -> dict[str, Any]:
        """The JSON object of a saved collection; `protected` only when set, so that documents
        written before the flag existed and after are the same."""
        out: dict[str, Any] = {
            "id": self.id,
            "text": self.text,
            "title": self.title,
            "metadata": self.metadata,
        }
        if self.protected:
            out["protected"] = True
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Document:
        return cls(
            id=obj["id"],
            text=obj["text"],
            title=obj.get("title", ""),
            metadata=obj.get("metadata", {}),
            protected=obj.get("protected", False),
        )
