"""The fidelity gate on literal figures: which document-cache policy serves by default, the
result file it reads, and how a request's `ragspeed.document_cache` combines with it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.gateway.fidelity_gate import (
    EXACT,
    FidelityResult,
    PolicyFigures,
    RequestDocumentCache,
    choose_default,
    fidelity_key,
    read_result,
    result_path,
    server_default,
    write_result,
)
from ragspeed.gateway.protocol import RagspeedOptions
from ragspeed.gateway.settings import Settings

REUSE = {"policy": "reuse", "num_tokens": 16, "ratio": 0.15, "glue": "reuse"}
SINK = {"policy": "sink", "num_tokens": 32, "ratio": 0.15, "glue": "reuse"}
BLEND = {"policy": "blend", "num_tokens": 16, "ratio": 0.3, "glue": "reuse"}


def figures(name, options, identical, top1, warm_ms):
    return PolicyFigures(name, options, 30, identical, top1, 0.01, warm_ms, 900.0)


def result(*policies, key="k" * 64, exact_ms=None):
    return FidelityResult(
        key, "m", "2026-12-07T03:00:00+00:00", "cpu", 30, tuple(policies), ttft_exact_ms=exact_ms
    )


def test_the_cheapest_passing_policy_is_chosen():
    chosen = choose_default(
        result(
            figures("reuse", REUSE, 0.40, 0.90, 180.0),
            figures("blend@30", BLEND, 1.00, 1.00, 3000.0),
            figures("sink@32", SINK, 29 / 30, 0.995, 400.0),
        )
    )
    assert chosen.policy == "sink@32"
    assert chosen.options == DocumentCacheOptions("sink", num_tokens=32, glue="reuse")
    assert chosen.figures["identical"] == 0.9667 and chosen.figures["ttft_warm_ms"] == 400.0


def test_a_policy_short_of_either_threshold_fails_and_none_passing_is_exact_prefill():
    chosen = choose_default(
        result(
            figures("reuse", REUSE, 0.96, 0.98, 180.0),  # top-1 short
            figures("sink@32", SINK, 0.90, 0.999, 400.0),  # identical short
        )
    )
    assert chosen.options is None and chosen.policy == EXACT
    assert "best reuse: top-1 agreement 98.0% < 99%" in chosen.reason
    assert chosen.figures["policy"] == "reuse"


def test_a_passing_policy_hardly_faster_than_full_prefill_is_never_chosen():
    lossless = figures("blend@100", {**BLEND, "ratio": 1.0}, 1.0, 1.0, 9000.0)
    assert choose_default(result(lossless, exact_ms=8000.0)).policy == EXACT
    assert choose_default(result(lossless, exact_ms=11000.0)).policy == EXACT  # 0.82x: not worth it
    assert choose_default(result(lossless, exact_ms=12000.0)).policy == "blend@100"  # 0.75x


def test_without_a_measurement_the_default_is_exact_prefill():
    chosen = choose_default(None)
    assert (chosen.options, chosen.policy) == (None, EXACT)
    assert "ragspeed bench fidelity" in chosen.reason


def test_the_result_file_round_trips_under_its_key_and_another_key_finds_nothing(tmp_path):
    measured = result(figures("reuse", REUSE, 1.0, 1.0, 180.0))
    path = write_result(measured, tmp_path)
    assert path == result_path("k" * 64, tmp_path) and path.name == f"fidelity-{'k' * 32}.json"
    assert read_result("k" * 64, tmp_path) == measured
    assert read_result("j" * 64, tmp_path) is None


def test_a_corrupt_or_foreign_result_file_is_ignored(tmp_path):
    path = result_path("k" * 64, tmp_path)
    path.write_text("{not json", encoding="utf-8")
    assert read_result("k" * 64, tmp_path) is None
    record = result(figures("reuse", REUSE, 1.0, 1.0, 180.0), key="j" * 64).to_json()
    path.write_text(json.dumps(record), encoding="utf-8")  # another model's, under this name
    assert read_result("k" * 64, tmp_path) is None


def test_the_key_changes_with_the_fingerprint_and_the_prefill_path():
    fingerprint = {"model": "a", "kv_dtype": "torch.float16"}
    assert fidelity_key(fingerprint, "fp32") == fidelity_key(dict(fingerprint), "fp32")
    assert fidelity_key(fingerprint, "fp32") != fidelity_key(fingerprint, "bf16")
    assert fidelity_key(fingerprint, "fp32") != fidelity_key({**fingerprint, "model": "b"}, "fp32")


def test_modes_off_and_on_and_an_engine_without_document_reuse():
    configured = DocumentCacheOptions("reuse", glue="reuse")
    reusing = SimpleNamespace(documents=object())
    assert server_default("off", configured, reusing).options is None
    assert server_default("on", configured, reusing).options == configured
    assert server_default("on", configured, None).options is None
    assert server_default("auto", configured, SimpleNamespace(documents=None)).policy == EXACT


def preparer(mode: str, gated: DocumentCacheOptions | None) -> RequestDocumentCache:
    default = None if mode != "auto" else SimpleNamespace(options=gated)
    options = Settings(document_cache=mode).engine
    return RequestDocumentCache(mode, options.document_cache_options(), default)  # type: ignore[arg-type]


def asking(document_cache) -> RagspeedOptions:
    return RagspeedOptions.model_validate({"document_cache": document_cache})


def test_auto_applies_the_gates_choice_and_exact_prefill_without_one():
    sink = DocumentCacheOptions("sink", num_tokens=32, glue="reuse")
    assert preparer("auto", sink).document_cache(None) == sink
    assert preparer("auto", sink).document_cache(None, compressed=True) is None
    assert preparer("auto", None).document_cache(None) is None


def test_a_request_may_always_ask_for_a_policy_or_for_exact_prefill():
    sink = DocumentCacheOptions("sink", num_tokens=32, glue="reuse")
    assert preparer("auto", None).document_cache(asking(True)) == DocumentCacheOptions("reuse", glue="reuse")
    assert preparer("auto", sink).document_cache(asking(True)) == sink
    assert preparer("auto", sink).document_cache(asking(False)) is None
    assert preparer("off", None).document_cache(asking({"policy": "blend", "ratio": 0.5})) == (
        DocumentCacheOptions("blend", ratio=0.5, glue="reuse")
    )
    assert preparer("on", None).document_cache(None) == DocumentCacheOptions("reuse", glue="reuse")
