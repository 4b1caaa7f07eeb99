"""`ragspeed eval rag`: scoring, the paired bootstrap, data and configuration parsing, the
stream timing, the figures on literal observations, the page in headless Chromium, and whole
runs through the gateway and the native engine on a tiny Llama."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ragspeed.ab.quality import accuracy, exact_match, f1, normalize
from ragspeed.ab.stats import paired_bootstrap_difference
from ragspeed.evals.cli import eval_group
from ragspeed.evals.rag import (
    Passage,
    RagExample,
    RagObservation,
    RagRun,
    compressed_config,
    distinct_passages,
    format_text,
    load_examples,
    parse_configs,
    rotated,
    run_rag_eval,
    summarize,
)
from ragspeed.evals.rag_gateway import parse_stream
from ragspeed.evals.rag_report import render_html

# ------------------------------------------------------------------------------- scoring


def test_normalization_subspan_em_and_f1_on_literals():
    assert normalize("The  Wilhelm Conrad Röntgen!") == "wilhelm conrad röntgen"
    assert normalize("An apple, a pear.") == "apple pear"
    assert accuracy("It went to Wilhelm Conrad Röntgen, in 1901.", ["Röntgen", "Lorentz"]) == 1.0
    assert accuracy("It went to Lorentz.", ["Röntgen"]) == 0.0
    assert accuracy("anything", ["The"]) == 0.0  # an answer that normalises to nothing never matches
    assert exact_match("the Röntgen.", ["Röntgen"]) == 1.0
    assert exact_match("Röntgen in 1901", ["Röntgen"]) == 0.0
    assert f1("Wilhelm Röntgen", ["Wilhelm Conrad Röntgen"]) == pytest.approx(0.8)
    assert f1("Lorentz", ["Röntgen"]) == 0.0


def test_paired_bootstrap_ci_on_literals():
    same = paired_bootstrap_difference([1, 0, 1, 0], [1, 0, 1, 0])
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    # b answers 5 more of 10 questions: the difference is 0.5, its CI well above 0.
    better = paired_bootstrap_difference([1, 0, 0, 1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 1, 1, 0, 1])
    assert (better.value, better.low, better.high) == (0.5, 0.2, 0.8)
    # The same changes in both directions: the CI straddles 0.
    mixed = paired_bootstrap_difference([1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 1, 0])
    assert mixed.value == 0.0 and mixed.low < 0 < mixed.high
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap_difference([1, 0], [1])


# -------------------------------------------------------------------------- data, configs


def test_bad_lines_are_skipped_with_their_line_numbers(tmp_path):
    good = {
        "question": "q",
        "answers": ["a"],
        "documents": [{"title": "t", "text": "x"}, "y"],
        "gold_index": 1,
    }
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"question": "q", "documents": ["x"]}),
        "",
        json.dumps({"question": "q", "answers": ["a"], "documents": [{"title": "t"}]}),
        json.dumps({**good, "gold_index": 7}),
        json.dumps(["a list"]),
        json.dumps(
            {"id": "h", "question": "q2", "answers": ["b"], "documents": [{"text": "u", "is_gold": True}]}
        ),
    ]
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    examples, skipped = load_examples(path)
    assert [(e.line, e.id, e.gold_index) for e in examples] == [(1, "line-1", 1), (8, "h", 0)]
    assert examples[0].documents == (Passage("t", "x"), Passage("", "y"))
    assert [s.line for s in skipped] == [2, 3, 5, 6, 7]
    assert skipped[0].reason.startswith("not valid JSON")
    assert skipped[1].reason == "'answers' is missing or not a non-empty list of strings"
    assert skipped[2].reason == "documents[0] is neither a string nor an object with a string 'text'"
    assert skipped[3].reason == "'gold_index' 7 is not a position among the 2 documents"
    assert skipped[4].reason == "not a JSON object"


def test_distinct_passages_drop_white_space_repeats():
    a = RagExample(1, "a", "q", ("x",), (Passage("T", "one  two"), Passage("U", "three")), 0)
    b = RagExample(2, "b", "q", ("x",), (Passage("T", "one two"), Passage("V", "four")), 0)
    assert [p.text for p in distinct_passages([a, b])] == ["one  two", "three", "four"]


def test_configuration_names():
    configs = parse_configs("full, coarse-to-fine@4x,first-docs@16x,retrieval", top_k=3)
    assert [c.name for c in configs] == ["full", "coarse-to-fine@4x", "first-docs@16x", "retrieval"]
    # Only the kv-* configurations reuse documents: the server's default document cache is off
    # in the others, so that `full` is a full prefill.
    assert configs[0].ragspeed == {"compression": False, "document_cache": False}
    assert configs[1].ragspeed == {
        "compression": {"method": "coarse-to-fine", "rate": 0.25},
        "document_cache": False,
    }
    assert configs[3].ragspeed["document_cache"] is False
    assert configs[2].ragspeed["compression"]["rate"] == 0.0625
    assert configs[3].ragspeed["retrieval"] == {"collection": "eval-rag", "top_k": 3, "mode": "hybrid"}
    assert not configs[3].send_documents and configs[3].needs_collection
    assert len(parse_configs("all")) == 22
    for bad, message in [
        ("full,first@2x", "unknown configuration 'first@2x'; valid: all, full, coarse-to-fine@2x"),
        ("bm25@1x", "unknown configuration 'bm25@1x'"),
        ("full,full", "configuration 'full' is named twice"),
        (" , ", "no configuration named"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_configs(bad)


def test_document_cache_configurations_name_their_policy_and_glue():
    reuse, sink, glued = parse_configs("kv-reuse,kv-sink@8,first-docs@4x+kv-blend@20:glue")
    assert reuse.ragspeed == {
        "compression": False,
        "document_cache": {"policy": "reuse", "glue": "recompute"},
    }
    assert sink.ragspeed["document_cache"] == {"policy": "sink", "glue": "recompute", "tokens": 8}
    assert glued.ragspeed == {
        "compression": {"method": "first-docs", "rate": 0.25},
        "document_cache": {"policy": "blend", "glue": "reuse", "ratio": 0.2},
    }
    assert reuse.reuses_documents and glued.reuses_documents
    for bad in ("kv-reuse@3", "kv-sink:gum", "kv-everything"):
        with pytest.raises(ValueError, match="unknown configuration"):
            parse_configs(bad)


def test_configurations_rotate_question_by_question():
    assert [rotated("abc", i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_ttft_is_the_first_chunk_with_content():
    def event(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    role = event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    hello = event({"choices": [{"delta": {"content": "Hel"}}]})
    final = event({"choices": [{"delta": {}}], "ragspeed": {"compression": {"failed": False}}})
    usage = event({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2}})
    # An event split across two body chunks counts when its end arrives.
    rest = event({"choices": [{"delta": {"content": "lo"}}]})
    chunks = [
        (0.1, role),
        (0.2, hello[:10]),
        (0.3, hello[10:] + rest),
        (0.4, final + usage + b"data: [DONE]\n\n"),
    ]
    reply = parse_stream(200, chunks)
    assert (reply.text, reply.first_content_s, reply.end_s) == ("Hello", 0.3, 0.4)
    assert reply.usage == {"prompt_tokens": 12, "completion_tokens": 2}
    assert reply.ragspeed == {"compression": {"failed": False}}
    refused = parse_stream(400, [(0.1, b'{"error": {"message": "unknown method"}}')])
    assert refused.error == "400: unknown method"
    failed = parse_stream(200, [(0.1, hello), (0.2, event({"error": {"message": "engine died"}}))])
    assert failed.error == "in-stream error: engine died"


# ------------------------------------------------------------------------- the figures


def _synthetic_run() -> RagRun:
    examples = tuple(
        RagExample(i + 1, f"q{i}", f"question {i}", ("x",), (Passage("", "d"),), gold)
        for i, gold in enumerate([0, 4, 0, 4])
    )
    configs = tuple(parse_configs("full,bm25@4x,fast@2x"))

    def obs(config, i, acc, ttft, tokens):
        return RagObservation(
            config,
            i,
            True,
            text="",
            ttft_ms=ttft,
            e2e_ms=ttft + 100,
            prompt_tokens=tokens,
            accuracy=acc,
            exact_match=0.0,
            f1=acc / 2,
        )

    observations = [
        obs("full", i, a, 1000 + 100 * i, 2000 + i) for i, a in enumerate([1.0, 0.0, 0.0, 1.0])
    ] + [obs("bm25@4x", i, a, 200 + 10 * i, 500 + i) for i, a in enumerate([1.0, 1.0, 0.0, 1.0])]
    return RagRun(examples, configs, tuple(observations), {"fast@2x": "400: no such model folder"})


def test_summary_figures_on_literal_observations():
    report = summarize(_synthetic_run(), num_resamples=2000, seed=0)
    full, bm25 = report["configs"]["full"], report["configs"]["bm25@4x"]
    assert (full["accuracy"], full["f1"], full["ttft_ms_p50"], full["ttft_ms_p95"]) == (0.5, 0.25, 1100, 1300)
    assert (full["e2e_ms_p50"], full["prompt_tokens_p50"]) == (1200, 2001)
    assert full["accuracy_minus_full"] == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0, "num_pairs": 4}
    assert bm25["accuracy"] == 0.75 and bm25["accuracy_minus_full"]["value"] == 0.25
    assert full["accuracy_by_gold_index"] == {"0": {"accuracy": 0.5, "n": 2}, "4": {"accuracy": 0.5, "n": 2}}
    assert bm25["accuracy_by_gold_index"] == {"0": {"accuracy": 0.5, "n": 2}, "4": {"accuracy": 1.0, "n": 2}}
    assert report["configs"]["fast@2x"] == {"status": "failed", "error": "400: no such model folder"}
    assert report["gold_positions"] == [0, 4]
    text = format_text(report)
    assert "failed: fast@2x: 400: no such model folder" in text
    assert re.search(r"bm25@4x\s+4\s+0\.750\s+0\.000\s+0\.375\s+\+0\.250 \[", text)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


# Run in the page after layout: what the browser drew, written where --dump-dom shows it.
_PROBE = """<script>
const svgs = [...document.querySelectorAll('svg')].map(s => {
  const box = s.getBBox(); return {w: box.width, h: box.height, points: s.querySelectorAll('circle.point').length,
  lines: s.querySelectorAll('polyline.series').length};
});
const tables = [...document.querySelectorAll('table')].map(t => ({rows: t.rows.length, h: t.getBoundingClientRect().height}));
document.body.setAttribute('data-probe', JSON.stringify({svgs, tables}));
</script></body>"""


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
def test_page_renders_its_svg_and_tables_in_headless_chromium(tmp_path):
    report = summarize(_synthetic_run())
    report["setup"] = {"model": "tiny"}
    page = render_html(report, "machine: test").replace("</body>", _PROBE)
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched
    path = tmp_path / "rag.html"
    path.write_text(page, encoding="utf-8")
    dom = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    probe = json.loads(re.search(r'data-probe="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    scatter, by_position = probe["svgs"]
    assert scatter["points"] == 2 and scatter["w"] > 500 and scatter["h"] > 300  # full and bm25@4x
    assert by_position["points"] == 4 and by_position["lines"] == 2 and by_position["w"] > 500
    summary, positions, setup = probe["tables"]
    assert (summary["rows"], positions["rows"], setup["rows"]) == (4, 3, 2)  # header + configs
    assert all(t["h"] > 20 for t in probe["tables"])
    assert "fast@2x" in dom and "400: no such model folder" in dom


# ------------------------------------------------------------- through the gateway and engine


def _passage(topic: str, n: int) -> str:
    return " ".join(
        f"The {topic} record number {k} notes a detail of {topic} history in plain words." for k in range(n)
    )


def write_data(path: Path) -> Path:
    """Three questions of four documents (~450 tokens in all, above the compression break-even),
    the gold one at 0, 3 and 0; and a bad line between them."""
    records = []
    for i, (topic, answer, gold) in enumerate(
        [("river", "Danube", 0), ("tower", "Eiffel", 3), ("comet", "Halley", 0)]
    ):
        docs = [
            {"title": f"{topic} {k}", "text": _passage(f"{topic} {k}", 5), "is_gold": False} for k in range(4)
        ]
        docs[gold] = {
            "title": topic,
            "text": f"The answer is {answer}. " + _passage(topic, 4),
            "is_gold": True,
        }
        records.append(
            json.dumps(
                {
                    "id": f"t{i}",
                    "question": f"which {topic}?",
                    "answers": [answer],
                    "gold_index": gold,
                    "documents": docs,
                }
            )
        )
    records.insert(1, '{"question": "broken"')
    path.write_text("\n".join(records) + "\n", encoding="utf-8")
    return path


def tiny_settings(tiny_model: Path) -> dict:
    return {
        "engine": "native",
        "model": str(tiny_model),
        "max_model_len": 2048,
        "num_kv_cache_tokens": 8192,
        "num_threads": 1,
    }


class BrokenCompressor:
    name = "broken"

    def compress(self, question, documents, budget):
        raise RuntimeError("the model folder is missing")


def test_failing_configurations_are_reported_and_the_run_goes_on(tiny_model, tmp_path, monkeypatch):
    from ragspeed.compression.registry import COMPRESSORS

    monkeypatch.setitem(COMPRESSORS, "broken", lambda options: BrokenCompressor())
    configs = [*parse_configs("full,broken@2x,retrieval", top_k=2), compressed_config("no-such-method", 2)]
    report = run_rag_eval(
        write_data(tmp_path / "qa.jsonl"), configs, settings_values=tiny_settings(tiny_model), max_tokens=4
    )
    assert report["failed"]["broken@2x"] == (
        "the compressor 'broken' raised (RuntimeError: the model folder is missing); "
        "the gateway sent the documents uncompressed"
    )
    assert report["failed"]["no-such-method@2x"].startswith(
        "400: unknown compression method 'no-such-method'"
    )
    full, retrieval = report["configs"]["full"], report["configs"]["retrieval"]
    assert (full["status"], full["num_questions"], full["num_errors"]) == ("ok", 3, 0)
    assert (retrieval["status"], retrieval["num_errors"]) == ("ok", 0)
    # Two retrieved passages of the collection's 12 (3 questions x 4) instead of four given ones.
    assert report["setup"]["collection_documents"] == 12
    assert retrieval["prompt_tokens_p50"] < full["prompt_tokens_p50"]
    assert retrieval["accuracy_minus_full"]["num_pairs"] == 3
    assert {o["config"] for o in report["observations"]} == {"full", "retrieval"}
    assert report["skipped_lines"] == [{"line": 2, "reason": "not valid JSON (Expecting ',' delimiter)"}]


def test_eval_rag_command_end_to_end(tiny_model, tmp_path):
    data = write_data(tmp_path / "qa.jsonl")
    settings = [
        f"--set={k}={v}" for k, v in tiny_settings(tiny_model).items() if k not in ("model", "num_threads")
    ]
    out_json, out_html = tmp_path / "rag.json", tmp_path / "rag.html"
    args = [
        "rag",
        "--data",
        str(data),
        "--limit",
        "3",
        "--configs",
        "full,first-docs@2x",
        "--model",
        str(tiny_model),
    ]
    args += [
        "--threads",
        "1",
        "--max-tokens",
        "4",
        *settings,
        "--json",
        str(out_json),
        "--html",
        str(out_html),
    ]
    result = CliRunner().invoke(eval_group, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("machine: ") and "eval rag: 8/8 requests" in result.stderr
    assert "skipped 1 invalid line(s): 2 (not valid JSON" in result.stdout
    report = json.loads(out_json.read_text())
    full, first = report["configs"]["full"], report["configs"]["first-docs@2x"]
    assert (full["num_questions"], first["num_questions"], first["num_errors"]) == (3, 3, 0)
    assert full["accuracy_minus_full"] == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0, "num_pairs": 3}
    assert first["num_uncompressed"] == 0 and first["compression_ms_p50"] > 0
    assert first["prompt_tokens_p50"] < 0.7 * full["prompt_tokens_p50"]
    assert 0 < full["ttft_ms_p50"] <= full["e2e_ms_p50"]
    assert set(full["accuracy_by_gold_index"]) == {"0", "3"}
    assert len(report["observations"]) == 6 and report["machine"].startswith("machine: ")
    # Whatever the server's document-cache default, full context is a full prefill.
    assert all(o["documents_hit"] is None for o in report["observations"])
    assert out_html.read_text().count("<svg") == 2


def test_bad_options_are_named(tmp_path):
    data = write_data(tmp_path / "qa.jsonl")
    runner = CliRunner()
    limit = runner.invoke(eval_group, ["rag", "--data", str(data), "--limit", "0"])
    assert limit.exit_code == 2 and "Invalid value for '--limit'" in limit.output
    configs = runner.invoke(eval_group, ["rag", "--data", str(data), "--configs", "full,first@2x"])
    assert configs.exit_code == 2 and "--configs" in configs.output and "first-docs@2x" in configs.output
    setting = runner.invoke(eval_group, ["rag", "--data", str(data), "--set", "colour=blue"])
    assert setting.exit_code == 2 and "'colour' is not a `ragspeed serve` setting" in setting.output
    missing = runner.invoke(eval_group, ["rag", "--data", str(tmp_path / "absent.jsonl")])
    assert missing.exit_code == 2 and "--data" in missing.output


def test_fidelity_against_full_on_literal_answers():
    from ragspeed.evals.fidelity import QuestionFidelity

    examples = tuple(RagExample(i + 1, f"q{i}", "q", ("x",), (Passage("", "d"),), 0) for i in range(4))
    configs = tuple(parse_configs("full,kv-reuse"))

    def obs(config, i, text):
        return RagObservation(config, i, True, text=text, ttft_ms=1.0, e2e_ms=2.0, accuracy=0.0)

    full = [obs("full", i, t) for i, t in enumerate(["Paris", "1901", "Marie Curie", "blue"])]
    reuse = [obs("kv-reuse", i, t) for i, t in enumerate(["Paris", "1902", "Marie Curie", "red"])]
    forced = {
        0: QuestionFidelity(True, (True,), (0.0,)),
        1: QuestionFidelity(False, (True, False, True), (0.0, 0.4, 0.2)),
    }
    run = RagRun(examples, configs, tuple(full + reuse), {}, fidelity={"kv-reuse": forced})
    report = summarize(run, num_resamples=200)
    fidelity = report["configs"]["kv-reuse"]["fidelity"]
    assert (fidelity["num_pairs"], fidelity["identical"]) == (4, 0.5)
    assert fidelity["top1_agreement"] == 0.75 and fidelity["kl_mean"] == pytest.approx(0.15)
    assert fidelity["num_positions"] == 4
    assert report["configs"]["full"]["fidelity"]["identical"] == 1.0
    assert report["configs"]["full"]["fidelity"]["top1_agreement"] is None  # not measured
    assert re.search(r"kv-reuse\s+4\s+0\.000.*\s0\.500\s+0\.750\s+0\.150\s", format_text(report))


def test_teacher_forced_fidelity_of_a_lossless_repair_end_to_end(tiny_model, tmp_path):
    # blend recomputing every document token gives full prefill's KV: the same answers and the
    # same next token at every position of them.
    configs = parse_configs("full,kv-blend@100")
    report = run_rag_eval(
        write_data(tmp_path / "qa.jsonl"), configs, settings_values=tiny_settings(tiny_model), max_tokens=4
    )
    fidelity = report["configs"]["kv-blend@100"]["fidelity"]
    assert fidelity["identical"] == 1.0 and fidelity["top1_agreement"] == 1.0
    assert fidelity["num_positions"] >= 3 and fidelity["kl_mean"] < 1e-3
