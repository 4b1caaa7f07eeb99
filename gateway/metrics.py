"""Prometheus metrics of one gateway, on a registry of its own (no module-global state).

Latencies are labelled by model and A/B arm; the engine's own figures (KV blocks, prefix cache
hits) are read from `EngineClient.stats()` at scrape time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_LABELS = ("model", "arm")


class _EngineStatsCollector:
    def __init__(self, stats: Callable[[], dict[str, float]], model: str):
        self._stats, self._model = stats, model

    def collect(self):
        try:
            stats = self._stats()
        except Exception:  # an engine still loading has no stats yet
            stats = {}
        for key, value in sorted(stats.items()):
            name = "ragspeed_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            family = GaugeMetricFamily(name, f"engine statistic {key}", labels=["model"])
            family.add_metric([self._model], float(value))
            yield family


class _PrefixCacheCollector:
    """The prefix cache's counters (in tokens, monotonic in the engine) as Prometheus counters,
    and its usage as a gauge; engines without a prefix cache export nothing."""

    def __init__(self, stats: Callable[[], dict[str, float]], model: str):
        self._stats, self._model = stats, model

    def collect(self):
        try:
            stats = self._stats()
        except Exception:
            stats = {}
        for key, name, doc in (
            (
                "prefix_cache_queries_tokens",
                "ragspeed_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
            ),
            (
                "prefix_cache_hits_tokens",
                "ragspeed_prefix_cache_hits",
                "Prompt tokens found in the prefix cache (their prefill skipped).",
            ),
        ):
            if key in stats:
                family = CounterMetricFamily(name, doc, labels=["model"])
                family.add_metric([self._model], float(stats[key]))
                yield family
        if "kv_cache_usage" in stats:
            family = GaugeMetricFamily(
                "ragspeed_prefix_cache_usage",
                "Share of KV cache blocks in use (running requests and pins).",
                labels=["model"],
            )
            family.add_metric([self._model], float(stats["kv_cache_usage"]))
            yield family


class _DocumentCacheCollector:
    """The document KV store's figures by tier (engine.native.core.document_kv's `document_cache_*` stats):
    lookups, hits, evictions and refused files as counters; hit rates (hits over lookups since
    start: all, RAM; disk: over the lookups that reached a file), bytes, budgets and entries as
    gauges. Engines without a document store export nothing."""

    # (name, help, family, {tier: stats key after "document_cache_"})
    _BY_TIER: tuple[tuple[str, str, type, dict[str, str]], ...] = (
        (
            "ragspeed_document_cache_hits",
            "Documents found in the store, by tier.",
            CounterMetricFamily,
            {"ram": "ram_hits", "disk": "disk_hits"},
        ),
        (
            "ragspeed_document_cache_evictions",
            "Documents dropped for room, by tier.",
            CounterMetricFamily,
            {"ram": "evictions", "disk": "disk_evictions"},
        ),
        (
            "ragspeed_document_cache_hit_rate",
            "Share of lookups that hit since start, by tier (disk: of the lookups that reached a file).",
            GaugeMetricFamily,
            {"all": "hit_rate", "ram": "ram_hit_rate", "disk": "disk_hit_rate"},
        ),
        (
            "ragspeed_document_cache_bytes",
            "Bytes held, by tier (RAM: KV payload; disk: file sizes).",
            GaugeMetricFamily,
            {"ram": "stored_bytes", "disk": "disk_bytes"},
        ),
        (
            "ragspeed_document_cache_capacity_bytes",
            "Budget in bytes, by tier (disk -1: unbounded, 0: no disk tier).",
            GaugeMetricFamily,
            {"ram": "capacity_bytes", "disk": "disk_capacity_bytes"},
        ),
        (
            "ragspeed_document_cache_entries",
            "Documents held, by tier.",
            GaugeMetricFamily,
            {"ram": "entries", "disk": "disk_entries"},
        ),
    )

    def __init__(self, stats: Callable[[], dict[str, float]], model: str):
        self._stats, self._model = stats, model

    def collect(self):
        try:
            stats = self._stats()
        except Exception:
            stats = {}
        if "document_cache_hits" not in stats:
            return
        lookups = CounterMetricFamily(
            "ragspeed_document_cache_lookups", "Documents looked up in the store.", labels=["model"]
        )
        lookups.add_metric(
            [self._model], stats["document_cache_hits"] + stats.get("document_cache_misses", 0.0)
        )
        yield lookups
        for name, doc, kind, keys in self._BY_TIER:
            family = kind(name, doc, labels=["model", "tier"])
            for tier, key in keys.items():
                value = stats.get(f"document_cache_{key}")
                if value is not None:
                    family.add_metric([self._model, tier], float(value))
            yield family
        if "document_cache_rejected_files" in stats:
            rejected = CounterMetricFamily(
                "ragspeed_document_cache_rejected_files",
                "Store files refused and deleted: truncated, forged (HMAC), corrupt or of another shape.",
                labels=["model"],
            )
            rejected.add_metric([self._model], float(stats["document_cache_rejected_files"]))
            yield rejected


class _AdmissionCollector:
    def __init__(self, fit: Callable[[], dict[str, float]], model: str):
        self._fit, self._model = fit, model

    def collect(self):
        for key, value in sorted(self._fit().items()):
            family = GaugeMetricFamily(
                f"ragspeed_admission_{key}", f"admission's fitted service time: {key}", labels=["model"]
            )
            family.add_metric([self._model], value)
            yield family


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "ragspeed_time_to_first_token_seconds",
            "Time to first token.",
            _LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_predicted = Histogram(
            "ragspeed_time_to_first_token_predicted_seconds",
            "Time to first token predicted at admission (gateway.admission), beside the actual.",
            _LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_refused = Counter(
            "ragspeed_ttft_refused_requests",
            "Requests refused with 429 because their predicted time to first token passed their deadline;"
            " stage: arrival (before their preparation's costly stages) or admission (after them).",
            ("model", "stage"),
            registry=r,
        )
        self.tpot = Histogram(
            "ragspeed_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _LABELS,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ragspeed_e2e_request_latency_seconds",
            "End-to-end request latency.",
            _LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "ragspeed_stage_seconds",
            "Time spent in each pipeline stage.",
            (*_LABELS, "stage"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ragspeed_prompt_tokens", "Prompt tokens sent to the engine.", _LABELS, registry=r
        )
        self.cached_tokens = Counter(
            "ragspeed_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            _LABELS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "ragspeed_generation_tokens", "Generated tokens.", _LABELS, registry=r
        )
        self.requests = Counter(
            "ragspeed_requests", "Finished requests by outcome.", (*_LABELS, "outcome"), registry=r
        )
        self.in_flight = Gauge(
            "ragspeed_requests_in_flight", "Requests being served now.", _LABELS, registry=r
        )
        self.compression_fallbacks = Counter(
            "ragspeed_compression_failures",
            "Compressions that failed open (prompt sent uncompressed).",
            _LABELS,
            registry=r,
        )
        self.documents_tokens = Counter(
            "ragspeed_document_tokens",
            "Document tokens before and after compression.",
            (*_LABELS, "phase"),
            registry=r,
        )

        self.precomputed_documents = Counter(
            "ragspeed_collection_precomputed_documents",
            "Collection documents sent to the document KV store, by outcome (computed, found, failed).",
            ("collection", "outcome"),
            registry=r,
        )
        self.precompute_queued = Gauge(
            "ragspeed_collection_precompute_queued",
            "Collection documents waiting for their KV to be precomputed.",
            ("collection",),
            registry=r,
        )

    def watch_engine(self, stats: Callable[[], dict[str, float]], model: str) -> None:
        self.registry.register(_EngineStatsCollector(stats, model))
        self.registry.register(_PrefixCacheCollector(stats, model))
        self.registry.register(_DocumentCacheCollector(stats, model))

    def watch_admission(self, fit: Callable[[], dict[str, float]], model: str) -> None:
        """The admission's service-time fit: `ragspeed_admission_step_seconds` and
        `ragspeed_admission_seconds_per_token`."""
        self.registry.register(_AdmissionCollector(fit, model))

    def render(self) -> bytes:
        return generate_latest(self.registry)
