"""The document store's figures by tier on /metrics (gateway.metrics), from engine stats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ragspeed.gateway.metrics import GatewayMetrics

STATS = {
    "document_cache_hits": 7.0,
    "document_cache_misses": 3.0,
    "document_cache_ram_hits": 5.0,
    "document_cache_disk_hits": 2.0,
    "document_cache_hit_rate": 0.7,
    "document_cache_ram_hit_rate": 0.5,
    "document_cache_disk_hit_rate": 1.0,
    "document_cache_stored_bytes": 4096.0,
    "document_cache_disk_bytes": 8192.0,
    "document_cache_capacity_bytes": 2**30,
    "document_cache_disk_capacity_bytes": 8 * 2**30,
    "document_cache_entries": 2.0,
    "document_cache_disk_entries": 4.0,
    "document_cache_evictions": 1.0,
    "document_cache_disk_evictions": 0.0,
    "document_cache_rejected_files": 1.0,
}


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("ragspeed_document_cache"):
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))
                out[(sample.name, labels)] = sample.value
    return out


def test_document_cache_by_tier():
    metrics = GatewayMetrics()
    metrics.watch_engine(lambda: STATS, "m")
    got = samples(metrics)
    assert got[("ragspeed_document_cache_lookups_total", ())] == 10
    assert got[("ragspeed_document_cache_hits_total", (("tier", "ram"),))] == 5
    assert got[("ragspeed_document_cache_hits_total", (("tier", "disk"),))] == 2
    assert got[("ragspeed_document_cache_hit_rate", (("tier", "all"),))] == 0.7
    assert got[("ragspeed_document_cache_hit_rate", (("tier", "disk"),))] == 1.0
    assert got[("ragspeed_document_cache_bytes", (("tier", "ram"),))] == 4096
    assert got[("ragspeed_document_cache_bytes", (("tier", "disk"),))] == 8192
    assert got[("ragspeed_document_cache_capacity_bytes", (("tier", "disk"),))] == 8 * 2**30
    assert got[("ragspeed_document_cache_entries", (("tier", "disk"),))] == 4
    assert got[("ragspeed_document_cache_evictions_total", (("tier", "ram"),))] == 1
    assert got[("ragspeed_document_cache_rejected_files_total", ())] == 1


def test_no_document_store_exports_nothing():
    metrics = GatewayMetrics()
    metrics.watch_engine(lambda: {"kv_cache_usage": 0.5}, "m")
    assert samples(metrics) == {}
