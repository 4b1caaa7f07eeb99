"""`ragspeed bench documents`: its trials, its figures on a tiny model, its refusals."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ragspeed.bench.documents import (
    NUM_DOCUMENTS,
    bench_documents,
    file_trials,
    run_bench_documents,
    shipped_trials,
)


def test_shipped_trials_are_twenty_passages_rotated_for_each_question():
    trials = shipped_trials(3)
    assert [len(documents) for _, documents in trials] == [NUM_DOCUMENTS] * 3
    assert trials[1][1][0].text == trials[0][1][1].text
    assert all(len(d.text.split()) >= 50 for d in trials[0][1])


def test_file_trials_take_the_first_questions_and_name_a_bad_line(tmp_path):
    good = {"question": "Who?", "documents": [{"title": "T", "text": "x"}, "plain text"]}
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"question": "No documents"}) + "\n")
    ((question, documents),) = file_trials(path, 1)
    assert question == "Who?" and [(d.title, d.text) for d in documents] == [("T", "x"), ("", "plain text")]
    with pytest.raises(ValueError, match=r"qa.jsonl:3: not a question with documents"):
        file_trials(path, 2)
    path.write_text(json.dumps(good) + "\n")
    with pytest.raises(ValueError, match=r"1 question\(s\) with documents, 2 asked"):
        file_trials(path, 2)


def test_a_warm_request_computes_only_its_question_and_the_figures_hold_together(
    tiny_model, tmp_path, capsys
):
    figures = run_bench_documents(str(tiny_model), str(tmp_path / "out.json"), num_trials=2, threads=1)
    assert json.loads((tmp_path / "out.json").read_text()) == figures
    assert 0 < figures["fresh_tokens"] < 40 < figures["prompt_tokens"]
    assert figures["ttft_warm_ms"] > 0 and figures["ttft_warm_bound_ms"] > 0
    # The tiny llama: 2 layers, K and V of 2 heads of 16 dims each, stored in float16.
    assert figures["store_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert figures["store_documents_per_gb"] == pytest.approx(
        1e9 / (figures["store_bytes_per_token"] * figures["tokens_per_document"])
    )
    printed = capsys.readouterr().out
    assert printed.startswith("machine: ") and "warm bound" in printed


def test_a_bad_option_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    result = CliRunner().invoke(bench_documents, ["--data", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:1: not a question with documents" in result.output
    result = CliRunner().invoke(bench_documents, ["--glue", "sometimes"])
    assert result.exit_code == 2 and "'sometimes' is not one of 'recompute', 'reuse'" in result.output
