"""A compressor that scores units (sentences) against the question and keeps the best under
the budget. The methods differ only in their `UnitScorer`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ragspeed.compression.base import (
    CompressedDocument,
    CompressionError,
    CompressionResult,
    Document,
    Tokenizer,
    as_documents,
)
from ragspeed.compression.budget import Budget
from ragspeed.compression.selection import ORDERINGS, select_units
from ragspeed.compression.units import TokenCounter, UnitTable, build_unit_table


class UnitScorer(Protocol):
    def score(self, question: str, table: UnitTable, budget_tokens: int) -> np.ndarray:
        """[table.num_units] relevance; higher is kept first. Called only with units."""
        ...


def _dedup_key(text: str) -> str:
    return " ".join(text.lower().split())


class SentenceCompressor:
    def __init__(self, name: str, scorer: UnitScorer, *, order: str = "original"):
        if order not in ORDERINGS:
            raise CompressionError(f"order must be one of {sorted(ORDERINGS)}, got {order!r}", "order")
        self.name = name
        self.scorer = scorer
        self.order = order
        self._counter: TokenCounter | None = None

    def clear_caches(self) -> None:
        """Forget token counts and cached embeddings: the next call runs cold (for the eval)."""
        self._counter = None
        clear = getattr(self.scorer, "clear_caches", None)
        if clear is not None:
            clear()

    def _token_counter(self, tokenizer: Tokenizer) -> TokenCounter:
        # Counts are per tokenizer: a new tokenizer object starts a new memo.
        if self._counter is None or self._counter.tokenizer is not tokenizer:
            self._counter = TokenCounter(tokenizer)
        return self._counter

    def compress(
        self,
        question: str,
        documents: Sequence[Document],
        budget: Budget,
    ) -> CompressionResult:
        start = time.perf_counter()
        if not isinstance(question, str):
            raise CompressionError("question must be a string", "question")
        docs = as_documents(documents)
        counter = self._token_counter(budget.tokenizer)
        table = build_unit_table(docs, counter)
        num_original = sum(table.doc_num_tokens)
        protected_doc_tokens = sum(n for d, n in zip(docs, table.doc_num_tokens) if d.protected)
        num_budget = budget.document_tokens(num_original, protected_doc_tokens)
        chosen: list[int] = []
        scores = np.zeros(table.num_units)
        if table.num_units and num_budget > 0:
            scores = np.asarray(self.scorer.score(question, table, num_budget), dtype=np.float64)
            assert scores.shape == (table.num_units,)
            chosen = self._select(table, scores, num_budget)
        return self._assemble(docs, table, scores, chosen, num_original, num_budget, start, counter)

    @staticmethod
    def _select(table: UnitTable, scores: np.ndarray, budget: int) -> list[int]:
        # Duplicated documents repeat units: the copies score the same, so drop every copy after
        # the first (by position) before selecting; they would spend the budget twice.
        seen: set[str] = set()
        keep = np.ones(table.num_units, dtype=bool)
        for i, text in enumerate(table.texts):
            key = _dedup_key(text)
            keep[i] = key not in seen
            seen.add(key)
        masked = np.where(keep, scores, -np.inf)
        num_tokens = np.where(keep, table.num_tokens, budget + 1)  # never fits
        return [i for i in select_units(masked, num_tokens, budget) if keep[i]]

    def _assemble(
        self, docs, table, scores, chosen, num_original, budget, start, counter
    ) -> CompressionResult:
        kept: dict[int, list[int]] = {}
        relevance: dict[int, float] = {}
        for i in chosen:
            d = int(table.doc_index[i])
            kept.setdefault(d, []).append(i)
            relevance[d] = max(relevance.get(d, -np.inf), float(scores[i]))
        for d, doc in enumerate(docs):
            if doc.protected:
                kept[d] = []
                relevance[d] = np.inf
        order = ORDERINGS[self.order](list(kept), relevance)
        texts = [
            docs[d].text if docs[d].protected else " ".join(table.texts[i] for i in kept[d]) for d in order
        ]
        # Counted again as joined text: the joins may tokenize a little differently.
        kept_counts = counter.count(texts)
        out: list[CompressedDocument] = []
        for d, text, num_kept in zip(order, texts, kept_counts):
            doc = docs[d]
            if doc.protected:
                sentences, positions = table.doc_units[d], tuple(range(len(table.doc_units[d])))
            else:
                sentences = tuple(table.texts[i] for i in kept[d])
                positions = tuple(int(table.position[i]) for i in kept[d])
            out.append(
                CompressedDocument(
                    document=doc if text == doc.text else dataclasses.replace(doc, text=text),
                    sentences=sentences,
                    sentence_indices=positions,
                    num_original_tokens=table.doc_num_tokens[d],
                    num_kept_tokens=num_kept,
                )
            )
        return CompressionResult(
            method=self.name,
            documents=tuple(out),
            num_original_tokens=num_original,
            num_compressed_tokens=sum(d.num_kept_tokens for d in out),
            elapsed_s=time.perf_counter() - start,
            budget_tokens=budget,
            num_dropped_documents=len(docs) - len(out),
        )
