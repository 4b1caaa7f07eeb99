"""Cache-aware routing for the openai backend: the same static prefix goes to the same upstream.

Each upstream (a vLLM, SGLang or ragspeed replica) has its own prefix cache, so spreading the
requests of one system prompt round robin makes every replica prefill it. Here a request's
*affinity key* is the chained hash (`prompt_cache.hashing.hash_request_blocks`, the tenant's
`cache_salt` mixed into block 0) of the first `affinity_blocks` full blocks of its static prefix
(`prompt_token_ids[:num_static_tokens]`); requests with the same key land on the same upstream.

Placement is *consistent hashing with bounded loads* (Mirrokni, Thorup, Zadimoghaddam, 2018):
every upstream owns `virtual_nodes` points on a hash ring; a key walks clockwise from its point
and takes the first upstream that is available and whose in-flight count is below
`ceil(load_factor * (in_flight_total + 1) / num_available)`. So a hot prompt spills to the next
upstream on the ring once its home carries `load_factor` (1.25) times the mean load, and adding
or losing an upstream moves only the keys it owned. An upstream that is down (its circuit open,
or already tried by this request) is skipped: fail over to the next on the ring.

A request without a full static block has no key; the caller picks its upstream round robin.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Collection, Sequence

from ragspeed.prompt_cache.hashing import hash_request_blocks


class AffinityRouter:
    def __init__(
        self,
        upstreams: Sequence[str],
        *,
        block_size: int = 16,
        affinity_blocks: int = 4,
        load_factor: float = 1.25,
        virtual_nodes: int = 64,
    ):
        if not upstreams:
            raise ValueError("upstreams must not be empty")
        if block_size < 1 or affinity_blocks < 1 or virtual_nodes < 1:
            raise ValueError("block_size, affinity_blocks and virtual_nodes must be >= 1")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.upstreams = tuple(upstreams)
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.load_factor = load_factor
        points = sorted(
            (self._point(f"{upstream}#{i}".encode()), upstream)
            for upstream in self.upstreams
            for i in range(virtual_nodes)
        )
        self._ring_points = [point for point, _ in points]
        self._ring_upstreams = [upstream for _, upstream in points]
        self.in_flight: dict[str, int] = {upstream: 0 for upstream in self.upstreams}

    @staticmethod
    def _point(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")

    def key(
        self, prompt_token_ids: Sequence[int], num_static_tokens: int, cache_salt: str | None
    ) -> bytes | None:
        """The affinity key of a request, or None when its static prefix has no full block."""
        num_tokens = min(num_static_tokens, len(prompt_token_ids), self.block_size * self.affinity_blocks)
        hashes = hash_request_blocks(prompt_token_ids[:num_tokens], self.block_size, cache_salt=cache_salt)
        return hashes[-1] if hashes else None

    def pick(
        self,
        key: bytes,
        available: Callable[[str], bool] = lambda upstream: True,
        exclude: Collection[str] = (),
    ) -> str | None:
        """The upstream for `key`: the first on the ring from the key's point that is not
        excluded, is under the load bound and `available(upstream)` accepts (called last, once
        per candidate: a circuit breaker's half-open trial is taken only by the one chosen).
        None when every upstream is excluded or refused."""
        candidates = [u for u in self.upstreams if u not in exclude]
        if not candidates:
            return None
        total = sum(self.in_flight[u] for u in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        start = bisect.bisect(self._ring_points, self._point(key))
        seen: set[str] = set()
        overloaded: list[str] = []  # in ring order: used when every available one is over the bound
        for offset in range(len(self._ring_points)):
            upstream = self._ring_upstreams[(start + offset) % len(self._ring_points)]
            if upstream in seen or upstream in exclude:
                continue
            seen.add(upstream)
            if self.in_flight[upstream] >= bound:
                overloaded.append(upstream)
                continue
            if available(upstream):
                return upstream
        for upstream in overloaded:  # cannot happen with load_factor >= 1, kept for safety
            if available(upstream):
                return upstream
        return None

    def acquire(self, upstream: str) -> None:
        self.in_flight[upstream] += 1

    def release(self, upstream: str) -> None:
        assert self.in_flight[upstream] > 0, f"release without acquire for {upstream}"
        self.in_flight[upstream] -= 1
