"""One request's documents, as the document cache plans them: their store keys, their KV once
known, and what the request's response reports of them.

Terms as in engine.native.core.document_kv (placed spans, glue, start positions). A request holds its plan
(`Request.document_plan`); the plan holds no request, so the request stands below the document
cache that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragspeed.engine.protocol import DocumentCacheOptions, DocumentReuse


@dataclass(frozen=True)
class DocumentReuseByTier(DocumentReuse):
    """`DocumentReuse`, with where the hits came from: the store's RAM or disk tier, or a
    document prefill in flight for another request; and the stored bytes read from each tier."""

    num_hit_ram: int = 0
    num_hit_disk: int = 0
    num_hit_in_flight: int = 0
    bytes_ram: int = 0
    bytes_disk: int = 0

    @property
    def by_tier(self) -> dict[str, float]:
        """The response's figures (`ragspeed.document_cache`): hit rate (documents found over
        documents asked for), hits and stored bytes read by tier."""
        asked = self.num_hit + self.num_computed
        return {
            "hit_rate": self.num_hit / asked if asked else 0.0,
            "documents_hit_ram": self.num_hit_ram,
            "documents_hit_disk": self.num_hit_disk,
            "documents_hit_in_flight": self.num_hit_in_flight,
            "bytes_read_ram": self.bytes_ram,
            "bytes_read_disk": self.bytes_disk,
        }


@dataclass
class DocumentPlan:
    """One request's documents: their keys, and their KV once known (None: still in flight,
    or lost, then computed in context)."""

    options: DocumentCacheOptions
    spans: tuple[tuple[int, int], ...]  # the placed spans: documents, and glue when stored
    is_document: tuple[bool, ...]  # per span: a document (not glue)
    keys: tuple[str, ...]
    kv: list[torch.Tensor | None]  # per span, [2, L, n, H, D] in the storage dtype
    start_positions: list[int]
    kv_dtype: str  # the storage dtype
    num_hit: int = 0
    num_computed: int = 0
    num_recomputed_tokens: int = 0
    num_hit_ram: int = 0
    num_hit_disk: int = 0
    num_hit_in_flight: int = 0
    bytes_ram: int = 0
    bytes_disk: int = 0

    @property
    def variant_tag(self) -> str:
        """What the request's assembled KV depends on beyond its tokens (prompt_cache.hashing)."""
        o = self.options
        return f"documents:{o.policy}:{o.num_tokens}:{o.ratio}:{o.glue}:{self.kv_dtype}"

    def report(self) -> DocumentReuseByTier:
        return DocumentReuseByTier(
            self.num_hit,
            self.num_computed,
            self.num_recomputed_tokens,
            self.num_hit_ram,
            self.num_hit_disk,
            self.num_hit_in_flight,
            self.bytes_ram,
            self.bytes_disk,
        )
