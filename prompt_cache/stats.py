"""Prefix-cache statistics, counted in tokens (the unit of `ragspeed_prefix_cache_*_total`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """A snapshot of the manager's counters; the totals only grow.

    - `queries_tokens`: prompt tokens looked up by `get_computed_blocks` (with stats recorded).
    - `hits_tokens`: of those, tokens served from the cache.
    - `hit_rate`: hits_tokens / queries_tokens (a rate in [0, 1]; 0 before any query).
    - `num_cached_blocks`: blocks holding a hash now (referenced or free).
    - `usage`: fraction of all blocks referenced now.
    - `evictions`: cached blocks whose hash was dropped to reuse them.
    - `hash_collisions`: lookups where a hash matched but the stored content did not.
    """

    queries_tokens: int
    hits_tokens: int
    num_cached_blocks: int
    usage: float
    evictions: int
    hash_collisions: int = 0
    num_requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0

    def to_dict(self) -> dict[str, float]:
        """All numbers, `hit_rate` included, for `EngineClient.stats()` and /metrics."""
        return {**asdict(self), "hit_rate": self.hit_rate}
