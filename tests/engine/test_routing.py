"""Cache-aware routing: same static prefix -> same upstream, bounded load, fail over."""

from __future__ import annotations

from collections import Counter

import pytest

from ragspeed.engine.backends.remote.openai_backend import OpenAIEngine
from ragspeed.engine.backends.remote.routing import AffinityRouter
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import GenerationRequest

UPSTREAMS = ("http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1")


def prefix(i: int, length: int = 80) -> tuple[int, ...]:
    return tuple(1000 * i + t for t in range(length))


def test_same_static_prefix_same_upstream_and_salt_changes_the_key():
    router = AffinityRouter(UPSTREAMS, block_size=16, affinity_blocks=4)
    key = router.key(prefix(1) + (5, 6, 7), num_static_tokens=80, cache_salt=None)
    # Only the first 4 full static blocks count: the question after them does not.
    assert key == router.key(prefix(1) + (9, 9), num_static_tokens=80, cache_salt=None)
    assert key == router.key(prefix(1)[:64] + (1, 2, 3) * 10, num_static_tokens=64, cache_salt=None)
    assert key != router.key(prefix(1), num_static_tokens=80, cache_salt="tenant-b")
    assert router.key(prefix(1), num_static_tokens=15, cache_salt=None) is None  # no full block
    picks = {router.pick(key) for _ in range(5)}
    assert len(picks) == 1


def test_keys_spread_over_upstreams_and_removal_moves_only_its_keys():
    router = AffinityRouter(UPSTREAMS)
    keys = [router.key(prefix(i), 80, None) for i in range(300)]
    homes = [router.pick(k) for k in keys]
    counts = Counter(homes)
    assert set(counts) == set(UPSTREAMS) and min(counts.values()) > 60
    smaller = AffinityRouter(UPSTREAMS[:2])
    moved = sum(1 for k, home in zip(keys, homes) if home != UPSTREAMS[2] and smaller.pick(k) != home)
    assert moved == 0  # consistent hashing: keys of the surviving upstreams stay put


def test_bounded_load_spills_a_hot_prefix_to_the_next_upstream():
    router = AffinityRouter(UPSTREAMS, load_factor=1.25)
    key = router.key(prefix(7), 80, None)
    placed = []
    for _ in range(9):  # 9 concurrent requests of one prompt
        upstream = router.pick(key)
        router.acquire(upstream)
        placed.append(upstream)
    counts = Counter(placed)
    # The bound ceil(1.25 * (n + 1) / 3) lets the home take at most about 1.25x the mean.
    assert max(counts.values()) <= 4 and counts[placed[0]] == max(counts.values())
    for upstream in placed:
        router.release(upstream)
    assert set(router.in_flight.values()) == {0}


def test_fail_over_skips_excluded_and_unavailable_upstreams():
    router = AffinityRouter(UPSTREAMS)
    key = router.key(prefix(3), 80, None)
    home = router.pick(key)
    second = router.pick(key, exclude=(home,))
    assert second not in (home, None)
    assert router.pick(key, available=lambda u: u != home) == second
    assert router.pick(key, exclude=UPSTREAMS) is None


@pytest.mark.parametrize("bad", [dict(load_factor=0.9), dict(block_size=0), dict(affinity_blocks=0)])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        AffinityRouter(UPSTREAMS, **bad)


def test_openai_backend_routes_by_prefix_and_fails_over_when_the_circuit_opens():
    config = EngineConfig(backend="openai")
    backend = OpenAIEngine(config, UpstreamConfig(urls=UPSTREAMS, circuit_failures=1))
    request = GenerationRequest("r", prefix(2) + (1, 2), num_static_tokens=80)
    home = backend._pick_upstream(request)
    assert {backend._pick_upstream(request) for _ in range(4)} == {home}
    assert backend._pick_upstream(request, (home,)) != home  # the retry of a failed connect
    backend._failed(home)  # one failure opens the circuit (circuit_failures=1)
    assert backend._pick_upstream(request) != home
    plain = OpenAIEngine(config, UpstreamConfig(urls=UPSTREAMS, affinity=False))
    assert len({plain._pick_upstream(request) for _ in range(3)}) == 3  # round robin
