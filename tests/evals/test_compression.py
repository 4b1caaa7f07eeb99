"""The eval command on three real NQ examples (baselines and the fast method)."""

import json

from click.testing import CliRunner

from ragspeed.evals.cli import eval_group
from ragspeed.evals.compression import answer_retained, normalize_answer


def test_normalisation_as_in_lost_in_the_middle():
    assert normalize_answer("The  Wilhelm Conrad Röntgen!") == "wilhelm conrad röntgen"
    assert answer_retained("It went to Wilhelm Conrad Röntgen, in 1901.", ["wilhelm conrad röntgen"])
    assert not answer_retained("It went to Lorentz.", ["Röntgen"])


def test_eval_compression_writes_flat_json(shared_data, tmp_path, static_encoder):
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        eval_group,
        [
            "compression",
            "--data",
            str(shared_data / "nq_dev.jsonl"),
            "--limit",
            "3",
            "--methods",
            "first-docs,bm25,fast",
            "--rates",
            "4,8",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "first-docs" in result.output and "retention" in result.output
    flat = json.loads(out.read_text())
    for key in (
        "fast_retention_4x",
        "fast_latency_p50_ms",
        "fast_ratio_4x",
        "bm25_retention_8x",
        "first-docs_ratio_4x",
        "setup_num_examples",
    ):
        assert key in flat
    assert flat["setup_num_examples"] == 3
    assert 3.6 <= flat["fast_ratio_4x"] <= 4.4  # within 10% of the asked 4x


def test_bad_arguments_name_the_option(tmp_path):
    result = CliRunner().invoke(
        eval_group, ["compression", "--data", str(tmp_path / "absent.jsonl"), "--rates", "4,x"]
    )
    assert result.exit_code != 0
    assert "--rates" in result.output


TEXT = "Wilhelm Conrad Röntgen received the first Nobel Prize in Physics in 1901 for discovering X-rays."


def test_tokens_are_counted_with_the_served_models_tokenizer(tmp_path):
    from ragspeed.engine.native.loading.model_zoo import resolve_model
    from ragspeed.evals.cli import load_tokenizer

    tokenizer = load_tokenizer()  # the default model's: smollm2-135m-instruct
    assert tokenizer.name_or_path == resolve_model("smollm2-135m-instruct")
    assert len(tokenizer.encode(TEXT, add_special_tokens=False)) == 26  # MiniLM's tokenizer: 20
    data = tmp_path / "one.jsonl"
    row = {
        "id": "q",
        "question": "Who won?",
        "answers": ["Röntgen"],
        "documents": [{"title": "", "text": TEXT}],
    }
    data.write_text(json.dumps(row) + "\n", encoding="utf-8")
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        eval_group,
        ["compression", "--data", str(data), "--methods", "identity", "--rates", "1", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    flat = json.loads(out.read_text())
    assert (flat["identity_original_tokens_1x"], flat["setup_tokenizer"]) == (26, "smollm2-135m-instruct")


def test_an_unknown_model_names_the_option(tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text("", encoding="utf-8")
    result = CliRunner().invoke(eval_group, ["compression", "--data", str(data), "--model", "no-such-model"])
    assert result.exit_code == 2
    assert "--model" in result.output and "no-such-model" in result.output
