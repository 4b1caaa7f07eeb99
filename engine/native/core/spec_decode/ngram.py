"""Prompt lookup (n-gram) proposer: RAG answers copy spans of their documents.

Match the last n tokens of prompt + output (n from `max_n` down to `min_n`) against every
earlier place in prompt + output; at the LATEST earlier match, propose the tokens that followed
it. When the match is so recent that fewer than k tokens follow it (a loop of period p < k),
the proposal continues periodically: draft j copies (prompt + output + drafts so far)[start + j].
Pure token-id arithmetic: no model, no KV cache.

Each request keeps an index of its n-grams (`NgramIndex`: the latest start of every n-gram
that has a token after it), extended by the tokens appended since the last step: a lookup costs
the same whatever the context's length, where a scan of the whole context at every step would
grow with the prompt (a RAG prompt of several hundred tokens makes that a sizeable share of a
small model's decode step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class NgramIndex:
    """The latest start of each n-gram (n in min_n..max_n) of one growing token sequence,
    among those followed by at least one token."""

    def __init__(self, min_n: int, max_n: int):
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0  # windows starting before this position are indexed (per n: fewer)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the windows of `token_ids` (the sequence so far, a prefix-extension of what
        was indexed before) that now have a token after them."""
        length = len(token_ids)
        for n, latest in self.latest.items():
            for start in range(max(self.num_indexed - n, 0), length - n):
                latest[tuple(token_ids[start : start + n])] = start
        self.num_indexed = length

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts after `token_ids` (indexed by `extend` first)."""
        length = len(token_ids)
        for n in sorted(self.latest, reverse=True):
            if n >= length:
                continue
            start = self.latest[n].get(tuple(token_ids[length - n :]))
            if start is None:
                continue
            start += n
            drafts = list(token_ids[start : start + num_tokens])
            while len(drafts) < num_tokens:  # periodic continuation (see the module docstring)
                drafts.append(drafts[len(drafts) - (length - start)])
            return drafts
        return []


class NgramProposer:
    """The batch proposer (engine.native.core.spec_decode.proposer.Proposer): one `NgramIndex` per running
    request, dropped by `release`."""

    name = "ngram"

    def __init__(self, *, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}
        # Time the latest propose_batch spent indexing new requests' prompts: one-time work
        # (engine.native.core.spec_decode.proposer).
        self.setup_seconds = 0.0

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Drafts for one token sequence, from a fresh index (no state kept)."""
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        return self._propose(index, token_ids, num_tokens)

    def propose_batch(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        self.setup_seconds = 0.0
        for request, k in zip(requests, num_tokens):
            index = self._indexes.get(request.request_id)
            if index is None:  # indexing a new request's prompt: one-time work
                start = time.perf_counter()
                index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
                index.extend(request.all_token_ids)
                self.setup_seconds += time.perf_counter() - start
            else:
                index.extend(request.all_token_ids)
            drafts.append(self._propose(index, request.all_token_ids, k))
        return drafts

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _propose(self, index: NgramIndex, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Drafts from `index`, which holds `token_ids` already."""
        if num_tokens < 1 or len(token_ids) < self.min_n + 1:
            return []
        return index.propose(token_ids, num_tokens)
