"""The control arm: keeps every document as it is (rate and target are checked, not applied)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from ragspeed.compression.base import CompressionResult, DocumentLike, Tokenizer
from ragspeed.compression.budget import resolve_budget
from ragspeed.compression.policy import passthrough


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
        result = passthrough(self.name, documents, tokenizer, 0.0)
        budget = resolve_budget(
            result.num_original_tokens,
            rate=rate,
            target_tokens=target_tokens,
            protected_tokens=protected_tokens,
        )
        return dataclasses.replace(result, elapsed_s=time.perf_counter() - start, budget_tokens=budget)
