"""The control arm: keeps every document as it is (rate and target are checked, not applied)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from compression.base import (
    CompressedDocument,
    CompressionResult,
    DocumentLike,
    Tokenizer,
    as_documents,
    count_tokens,
)
from compression.budget import resolve_budget
from compression.sentences import split_sentences


class IdentityCompressor:
    name = "identity"

    def compress(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        *,
        tokenizer: Tokenizer,
        rate: float | None = None,
        target_tokens: int | None = None,
        protected_tokens: int = 0,
    ) -> CompressionResult:
        start = time.perf_counter()
        docs = as_documents(documents)
        out = []
        for doc in docs:
            n = count_tokens(tokenizer, doc.text)
            units = tuple(split_sentences(doc.text))
            out.append(CompressedDocument(doc.id, doc.title, doc.text, units, tuple(range(len(units))), n, n))
        total = sum(d.num_original_tokens for d in out)
        budget = resolve_budget(total, rate=rate, target_tokens=target_tokens, protected_tokens=protected_tokens)
        return CompressionResult(self.name, tuple(out), total, total, time.perf_counter() - start, budget)
