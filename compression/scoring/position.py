"""The keep-the-first-documents baseline: earlier units score higher."""

from __future__ import annotations

import numpy as np


class PositionScorer:
    def score(self, question: str, table, budget_tokens: int) -> np.ndarray:
        return -np.arange(table.num_units, dtype=np.float64)
