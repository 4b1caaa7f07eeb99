"""`ragspeed bench documents --hit-rate`: the store's hit rate over a pass of questions and the
same questions reversed, by the store's bookkeeping and through the engine, on a tiny model."""

from __future__ import annotations

import json

import pytest

from ragspeed.bench.documents import run_hit_rate


def qa_file(tmp_path, num_questions: int, documents_per_question: int = 3):
    """Questions of distinct documents, but the first document shared by all of them."""
    path = tmp_path / "qa.jsonl"
    lines = []
    for q in range(num_questions):
        documents = ["A passage every question retrieves."] + [
            f"Passage {q}-{d} about topic number {q * 10 + d}." for d in range(1, documents_per_question)
        ]
        lines.append(json.dumps({"question": f"Question {q}?", "documents": documents}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("bookkeeping", [True, False])
def test_every_document_hits_on_the_reversed_pass(tiny_model, tmp_path, bookkeeping, capsys):
    data = qa_file(tmp_path, 4)
    figures = run_hit_rate(
        str(tiny_model),
        str(tmp_path / "out.json"),
        data=data,
        num_trials=4,
        bookkeeping=bookkeeping,
        threads=1,
    )
    assert json.loads((tmp_path / "out.json").read_text()) == figures
    # 12 documents a pass; the shared one is new only to the first question.
    assert (figures["first_documents"], figures["reversed_documents"]) == (12, 12)
    assert figures["first_hit_rate"] == 3 / 12
    assert (figures["reversed_hit_rate"], figures["reversed_ram_hit_rate"]) == (1.0, 1.0)
    # The tiny llama: 2 layers, K and V of 2 heads of 16 dims, float16.
    assert figures["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert "reversed pass" in capsys.readouterr().out


def test_a_small_ram_tier_hits_from_disk(tiny_model, tmp_path):
    data = qa_file(tmp_path, 4)
    # Room in RAM for about one document of the tiny model: the rest comes back from disk.
    figures = run_hit_rate(
        str(tiny_model), None, data=data, num_trials=4, bookkeeping=True, ram_bytes=6000, threads=1
    )
    assert figures["reversed_hit_rate"] == 1.0 and figures["reversed_disk_hit_rate"] > 0.5
    assert figures["ram_evictions"] > 0 and figures["disk_evictions"] == 0
    no_disk = run_hit_rate(
        str(tiny_model),
        None,
        data=data,
        num_trials=4,
        bookkeeping=True,
        ram_bytes=2048,
        disk_bytes=0,
        threads=1,
    )
    assert no_disk["reversed_hit_rate"] < 0.5 and no_disk["disk_bytes"] == 0
