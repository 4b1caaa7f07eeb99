"""A compressor that keeps the most relevant documents whole and drops the rest.

Units are scored as in the sentence compressors (coarse-to-fine's scorer); a document's relevance
is its best unit's score, and whole documents are selected greedily under the budget. Kept text
is the document's own, byte for byte: a document seen before keeps its stored KV reusable (the
engine's document cache), which a document cut into sentences would not.
"""

from __future__ import annotations

import time

import numpy as np

from ragspeed.compression.base import CompressedDocument, CompressionResult
from ragspeed.compression.selection import ORDERINGS, select_units
from ragspeed.compression.sentence_compressor import SentenceCompressor, _dedup_key
from ragspeed.compression.units import UnitTable


def _doc_relevance(table: UnitTable, scores: np.ndarray) -> np.ndarray:
    """[num_documents] the best unit's score; -inf for documents without units (protected, empty)."""
    relevance = np.full(len(table.documents), -np.inf)
    np.maximum.at(relevance, table.doc_index, scores)
    return relevance


class DocumentSelector(SentenceCompressor):
    # `compress` is SentenceCompressor's; `_select` and `_assemble` work on whole documents.

    @staticmethod
    def _select(table: UnitTable, scores: np.ndarray, budget: int) -> list[int]:
        """Indices of the kept unprotected documents. A copy of a document seen before (by
        position, protected ones included) is dropped: it would spend the budget twice."""
        relevance = _doc_relevance(table, scores)
        num_tokens = np.asarray(table.doc_num_tokens, dtype=np.int64)
        seen = {_dedup_key(d.text) for d in table.documents if d.protected}
        keep = np.isfinite(relevance)
        for d, doc in enumerate(table.documents):
            key = _dedup_key(doc.text)
            keep[d] &= key not in seen
            seen.add(key)
        masked = np.where(keep, relevance, -np.inf)
        num_tokens = np.where(keep, num_tokens, budget + 1)  # never fits
        return [d for d in select_units(masked, num_tokens, budget) if keep[d]]

    def _assemble(
        self, docs, table, scores, chosen, num_original, budget, start, counter
    ) -> CompressionResult:
        relevance = _doc_relevance(table, scores)
        kept = {d: float(relevance[d]) for d in chosen}
        kept.update({d: np.inf for d, doc in enumerate(docs) if doc.protected})
        out = tuple(
            CompressedDocument(
                document=docs[d],
                sentences=table.doc_units[d],
                sentence_indices=tuple(range(len(table.doc_units[d]))),
                num_original_tokens=table.doc_num_tokens[d],
                num_kept_tokens=table.doc_num_tokens[d],
            )
            for d in ORDERINGS[self.order](list(kept), kept)
        )
        return CompressionResult(
            method=self.name,
            documents=out,
            num_original_tokens=num_original,
            num_compressed_tokens=sum(d.num_kept_tokens for d in out),
            elapsed_s=time.perf_counter() - start,
            budget_tokens=budget,
            num_dropped_documents=len(docs) - len(out),
        )
