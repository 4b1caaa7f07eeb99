"""Prompt lookup (n-gram) proposer: RAG answers copy spans of their documents.

Match the last n tokens of prompt + output (n from `max_n` down to `min_n`) against every
earlier place in prompt + output; at the LATEST earlier match, propose the tokens that followed
it. When the match is so recent that fewer than k tokens follow it (a loop of period p < k),
the proposal continues periodically: draft j copies (prompt + output + drafts so far)[start + j].
Pure token-id arithmetic: no model, no KV cache.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    name = "ngram"

    def __init__(self, *, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        length = len(token_ids)
        if num_tokens < 1 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # windows [length - n, n]: window i = tokens[i : i + n]; the last one (the suffix
            # itself) is excluded so a match always has at least one token after it.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                drafts = tokens[start : start + num_tokens].tolist()
                while len(drafts) < num_tokens:  # periodic continuation (see the docstring)
                    drafts.append(drafts[len(drafts) - (length - start)])
                return drafts
        return []
