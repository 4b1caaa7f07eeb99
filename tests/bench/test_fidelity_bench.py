"""`ragspeed bench fidelity`: its options on literals, and a run on the tiny model whose result
the server's gate reads back."""

from __future__ import annotations

import pytest

from ragspeed.bench.fidelity import parse_policies, run_bench_fidelity, select_documents
from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.evals.rag import Passage, RagExample
from ragspeed.gateway.fidelity_gate import choose_default, read_result
from ragspeed.shipped_data import NQ_QUESTIONS


def test_policy_names():
    assert parse_policies("reuse, sink@8,blend@15", "reuse") == {
        "reuse": DocumentCacheOptions("reuse", glue="reuse"),
        "sink@8": DocumentCacheOptions("sink", num_tokens=8, glue="reuse"),
        "blend@15": DocumentCacheOptions("blend", ratio=0.15, glue="reuse"),
    }
    for bad in ("sink", "blend@x", "reuse@3", "exact", ""):
        with pytest.raises(ValueError):
            parse_policies(bad, "reuse")


def test_the_gold_document_is_kept_when_the_documents_are_cut():
    passages = tuple(Passage(f"t{i}", f"text {i}") for i in range(20))
    late = RagExample(7, "q", "q?", ("a",), passages, 14)
    assert [d.title for d in select_documents(late, 4)] == ["t0", "t1", "t2", "t14"]
    early = RagExample(7, "q", "q?", ("a",), passages, 2)
    assert [d.title for d in select_documents(early, 4)] == ["t0", "t1", "t2", "t3"]
    assert select_documents(early, 4)[0].id == "7-0"


def test_a_run_on_the_tiny_model_writes_the_result_the_gate_reads(tiny_model, tmp_path):
    report = run_bench_fidelity(
        str(tiny_model),
        str(tmp_path / "fidelity.json"),
        data=NQ_QUESTIONS,
        policies="reuse,blend@100",
        limit=2,
        num_documents=2,
        max_tokens=4,
        cold_questions=1,
        results_dir=tmp_path,
        engine_values={"max_model_len": 2048, "num_kv_cache_tokens": 8192, "num_threads": 1},
        echo=lambda line: None,
    )
    lossless = report["policies"]["blend@100"]  # every document token recomputed
    assert (lossless["identical"], lossless["top1_agreement"], lossless["gate"]) == (1.0, 1.0, "pass")
    assert lossless["num_questions"] == 2 and lossless["ttft_cold_ms"] > 0
    result = read_result(report["fidelity_key"], tmp_path)
    assert result is not None and [p.name for p in result.policies] == ["reuse", "blend@100"]
    assert result.ttft_exact_ms == report["policies"]["exact"]["ttft_warm_ms"]
    assert choose_default(result).policy == report["default"]["policy"]
