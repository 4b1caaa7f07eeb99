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
