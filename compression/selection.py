"""Pick units under a token budget, then order the kept documents.

Selection is greedy by score: take the best unit that still fits, skip one that does not and try
the next (a long unit near the top does not end the selection early, so the achieved ratio stays
close to the asked one). Units are kept whole: nothing is cut inside a sentence.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def select_units(scores: np.ndarray, num_tokens: np.ndarray, budget_tokens: int) -> list[int]:
    """Indices of the kept units (ascending). Ties keep the earlier unit first."""
    assert scores.shape == num_tokens.shape
    chosen: list[int] = []
    used = 0
    smallest = int(num_tokens.min()) if len(num_tokens) else 0
    for i in np.argsort(-scores, kind="stable").tolist():
        n = int(num_tokens[i])
        if used + n <= budget_tokens:
            chosen.append(i)
            used += n
            if budget_tokens - used < smallest:
                break
    return sorted(chosen)


# An ordering takes the kept documents' indices (input order) and their relevance, and returns
# the output order.
Ordering = Callable[[list[int], dict[int, float]], list[int]]


def original_order(doc_ids: list[int], relevance: dict[int, float]) -> list[int]:
    return sorted(doc_ids)


def edges_order(doc_ids: list[int], relevance: dict[int, float]) -> list[int]:
    """Most relevant first, second most relevant last, and so on inward: models read the start
    and the end of a long context best ("lost in the middle")."""
    ranked = sorted(doc_ids, key=lambda d: (-relevance[d], d))
    front, back = ranked[0::2], ranked[1::2]
    return front + back[::-1]


ORDERINGS: dict[str, Ordering] = {"original": original_order, "edges": edges_order}
