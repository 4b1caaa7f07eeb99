"""Documents and search hits, the values that cross package boundaries.

A *document* (`ragspeed.document.Document`, the type the gateway and compression share) is the
unit that is indexed and retrieved: one chunk of a source file or one record given by the
caller. Its id is stable: the caller's id, or a content hash of the source name and the chunk
text, so re-ingesting the same file yields the same ids. Two documents with the same *content
key* (text with white space collapsed) are duplicates; only the first is kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ragspeed.document import Document

ID_HEX_CHARS = 16  # 64 bits of sha256: collisions need ~4e9 documents


@dataclass(frozen=True)
class Hit:
    document: Document
    score: float  # higher is better; its scale depends on the mode (cosine, BM25, RRF)
    rank: int  # 1 for the best hit


def document_id(source: str, text: str) -> str:
    """Stable id of a chunk: hash of where it came from and what it says."""
    digest = hashlib.sha256(f"{source}\x00{text}".encode()).hexdigest()
    return digest[:ID_HEX_CHARS]


def content_key(text: str) -> str:
    """Duplicate-detection key: the text with white space collapsed, hashed."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()[:ID_HEX_CHARS]


def embedding_text(document: Document) -> str:
    """What is embedded and BM25-indexed: the title gives short passages their topic."""
    return f"{document.title}\n{document.text}" if document.title else document.text
