"""The control arm: keeps every document as it is (rate and target are checked, not applied)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from ragspeed.compression.base import CompressionResult, Document
from ragspeed.compression.budget import Budget
from ragspeed.compression.policy import passthrough


class IdentityCompressor:
    name = "identity"

    def compress(
        self,
        question: str,
        documents: Sequence[Document],
        budget: Budget,
    ) -> CompressionResult:
        start = time.perf_counter()
        result = passthrough(self.name, documents, budget.tokenizer, 0.0)
        num_budget = budget.document_tokens(result.num_original_tokens)
        return dataclasses.replace(result, elapsed_s=time.perf_counter() - start, budget_tokens=num_budget)
