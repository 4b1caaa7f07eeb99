"""The fast scorer: static embeddings (sentence and document) plus BM25, no transformer.

score(unit) = cos(q, unit) + doc_weight * cos(q, unit's document) + bm25_weight * bm25(unit)

Units are embedded with their document's title in front; the document term lets a sentence
that only makes sense in its passage ("He was born in 1840.") rank with its passage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ragspeed.compression.scoring.bm25 import bm25_scores
from ragspeed.compression.scoring.static_encoder import StaticEncoder
from ragspeed.compression.units import UnitTable


@dataclass(frozen=True)
class CheapScores:
    unit_sim: np.ndarray  # [num_units] cos(q, titled unit), static embeddings
    doc_sim: np.ndarray  # [num_documents] cos(q, titled document)
    bm25: np.ndarray  # [num_units] BM25 of the titled unit, scaled to [0, 1]
    unit_score: np.ndarray  # [num_units] the fast method's combined score


class StaticBM25Scorer:
    def __init__(self, encoder: StaticEncoder, *, doc_weight: float = 1.0, bm25_weight: float = 0.3):
        self.encoder = encoder
        self.doc_weight = doc_weight
        self.bm25_weight = bm25_weight

    def score_parts(self, question: str, table: UnitTable) -> CheapScores:
        titled = table.titled()
        q = self.encoder.encode([question])[0]  # [dim]
        unit_sim = self.encoder.encode(titled) @ q  # [num_units]
        doc_sim = self.encoder.encode(table.titled_documents()) @ q  # [num_documents]
        bm25 = bm25_scores(question, titled)
        score = unit_sim + self.doc_weight * doc_sim[table.doc_index] + self.bm25_weight * bm25
        return CheapScores(unit_sim, doc_sim, bm25, score)

    def clear_caches(self) -> None:
        if self.encoder.cache is not None:
            self.encoder.cache.clear()

    def score(self, question: str, table: UnitTable, budget_tokens: int) -> np.ndarray:
        return self.score_parts(question, table).unit_score
