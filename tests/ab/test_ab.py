"""The offline A/B runner: arm files, workloads, statistics, quality, the report and the command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ragspeed.ab.arms import ArmError, load_all_arms, load_arms
from ragspeed.ab.cli import run_ab
from ragspeed.ab.quality import accuracy, contains_answer, exact_match, f1
from ragspeed.ab.report import build_report, format_text, render_html
from ragspeed.ab.runner import LoadShape, Observation, RunResult, arm_order, blocks, request_body
from ragspeed.ab.stats import bootstrap_median_difference, bootstrap_quantiles, mann_whitney_u
from ragspeed.ab.workload import Workload, keep_documents, load_workload

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- arms


def test_single_arm_file_is_named_by_its_stem(tmp_path):
    path = write(
        tmp_path / "fast.yaml",
        "engine: native\nenable-prefix-caching: false\n"
        "request:\n  ragspeed:\n    compression: {rate: 0.25}\n",
    )
    [arm] = load_arms(str(path))
    assert arm.name == "fast"
    assert dict(arm.settings) == {"engine": "native", "enable_prefix_caching": False}
    assert arm.request == {"ragspeed": {"compression": {"rate": 0.25}}}


def test_sections_of_one_file(tmp_path):
    path = write(tmp_path / "arms.yaml", "arms:\n  a: {engine: transformers}\n  b: {engine: native}\n")
    assert [a.name for a in load_arms(str(path))] == ["a", "b"]
    [b] = load_arms(f"{path}:b")
    assert (b.name, b.source, dict(b.settings)) == ("b", f"{path}:b", {"engine": "native"})
    with pytest.raises(ArmError, match="no arm section 'c'"):
        load_arms(f"{path}:c")


def test_unknown_key_names_file_line_and_key(tmp_path):
    path = write(tmp_path / "bad.yaml", "engine: native\n\nquantisation: int8\n")
    with pytest.raises(ArmError) as exc:
        load_arms(str(path))
    assert str(exc.value).startswith(f"{path}:3: key 'quantisation': unknown option")


def test_bad_value_names_file_line_and_key(tmp_path):
    path = write(tmp_path / "bad.yaml", "engine: native\nblock_size: -4\n")
    with pytest.raises(
        ArmError, match=rf"^{path}:2: key 'block_size': Input should be greater than or equal to 1"
    ):
        load_arms(str(path))
    path = write(tmp_path / "bad2.yaml", "model: x\nengine: warp\n")
    with pytest.raises(ArmError, match=rf"^{path}:2: key 'engine': unknown engine 'warp'"):
        load_arms(str(path))


def test_bad_request_overlay_names_the_nested_key(tmp_path):
    path = write(
        tmp_path / "bad.yaml",
        "arms:\n  x:\n    request:\n      ragspeed:\n        compression:\n          rate: 4\n",
    )
    with pytest.raises(ArmError, match=rf"^{path}:6: key 'arms.x.request.ragspeed.compression.rate'"):
        load_arms(str(path))
    path = write(tmp_path / "bad2.yaml", "request:\n  temprature: 0\n")
    with pytest.raises(ArmError, match=rf"^{path}:2: key 'request.temprature': unknown"):
        load_arms(str(path))


def test_invalid_yaml_and_duplicate_names(tmp_path):
    path = write(tmp_path / "broken.yaml", "engine: native\nmodel: [unclosed\n")
    with pytest.raises(ArmError, match=rf"^{path}:\d+: not valid YAML"):
        load_arms(str(path))
    a = write(tmp_path / "a.yaml", "engine: native\n")
    b = write(tmp_path / "b.yaml", "name: a\nengine: transformers\n")
    with pytest.raises(ArmError, match="two arms are named 'a'"):
        load_all_arms([str(a), str(b)])


def test_example_arms_load():
    arms = load_all_arms([str(REPO / "examples/ab/baseline.yaml"), str(REPO / "examples/ab/full.yaml")])
    assert [a.name for a in arms] == ["baseline", "full"]
    assert [a.settings["model"] for a in arms] == ["smollm2-135m-instruct"] * 2
    assert arms[1].request == {"ragspeed": {"compression": {"rate": 0.25}}}
    words = len((REPO / "ragspeed/bench/system_prompt.txt").read_text().split())
    assert 2000 <= words <= 2200


# ---------------------------------------------------------------- workload


def test_workload_skips_invalid_lines_with_their_numbers(tmp_path):
    lines = [
        json.dumps(
            {"question": "who?", "answers": ["Ann"], "documents": [{"title": "T", "text": "Ann did."}]}
        ),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "answers": ["hello"]}),
        "",
        json.dumps([1, 2]),
        json.dumps({"question": "q", "answers": "x", "documents": 3}),
        json.dumps({"prompt": "no"}),
        json.dumps({"messages": [], "max_tokens": 2}),
    ]
    path = write(tmp_path / "w.jsonl", "\n".join(lines) + "\n")
    workload = load_workload(path, system_prompt="Be brief.", max_tokens=5)
    assert [i.line for i in workload.items] == [1, 3]
    assert [s.line for s in workload.skipped] == [2, 5, 6, 7, 8]
    first = workload.items[0]
    assert first.body == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "who?"}],
        "max_tokens": 5,
        "temperature": 0,
        "documents": [{"title": "T", "text": "Ann did."}],
    }
    assert first.answers == ("Ann",)
    assert workload.items[1].body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert workload.skipped[0].reason.startswith("not valid JSON")
    assert workload.skipped[1].reason == "not a JSON object"
    assert load_workload(path, limit=1).items[0].line == 1


def test_keep_documents_keeps_the_gold_one():
    docs = [{"text": str(i), "is_gold": i == 7} for i in range(10)]
    assert [d["text"] for d in keep_documents(docs, 7, 3)] == ["0", "1", "7"]
    assert keep_documents(docs, 7, None) is docs


def test_nq_dev_loads(shared_data):
    workload = load_workload(shared_data / "nq_dev.jsonl", limit=5, num_documents=4)
    assert len(workload.items) == 5 and not workload.skipped
    assert all(len(i.body["documents"]) == 4 for i in workload.items)
    assert all(contains_answer(i.document_text, i.answers) for i in workload.items)


# ---------------------------------------------------------------- stats and quality


def test_mann_whitney_matches_the_normal_approximation():
    u, p = mann_whitney_u(list(range(1, 11)), list(range(11, 21)))
    assert u == 0.0 and p == pytest.approx(0.00018267179110955, rel=1e-9)
    u, p = mann_whitney_u([1, 2, 2, 3, 5, 8, 8, 9], [2, 3, 4, 4, 6, 9, 10, 11, 12])  # with ties
    assert u == 22.0 and p == pytest.approx(0.191738591021404, rel=1e-9)


def test_bootstrap_quantiles_and_difference():
    est = bootstrap_quantiles([float(x) for x in range(1, 101)], num_resamples=500, seed=0)
    assert (est[0.5].value, est[0.5].low, est[0.5].high) == (50.5, 41.5, 60.0)
    assert est[0.99].value == pytest.approx(99.01)
    diff, ratio = bootstrap_median_difference(
        [10.0] * 5 + [12.0] * 5, [1.0] * 5 + [2.0] * 5, num_resamples=500
    )
    assert (diff.value, diff.low, diff.high) == (-9.5, -11.0, -8.0)
    assert ratio.value == pytest.approx(11 / 1.5)


def test_quality_scores():
    assert exact_match("The Beatles!", ["beatles"]) == 1.0
    assert f1("Dan Stevens sang", ["Dan Stevens"]) == pytest.approx(0.8)
    assert accuracy("it was Dan Stevens.", ["Dan Stevens"]) == 1.0
    assert contains_answer("by Dan Stevens, and", ["dan stevens"])
    assert not contains_answer("Danny Stevenson", ["Dan Stevens"])


# ---------------------------------------------------------------- schedule and report


def test_schedule_rotates_arms_and_cuts_blocks():
    assert [arm_order(3, k) for k in range(3)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert [len(b) for b in blocks(tuple(range(10)), 4)] == [4, 4, 2]
    with pytest.raises(ValueError, match="rate"):
        LoadShape(rate=0)


def _synthetic(tmp_path):
    a_path = write(tmp_path / "slow.yaml", "engine: transformers\n")
    b_path = write(
        tmp_path / "fast.yaml", "engine: native\nrequest: {ragspeed: {compression: {rate: 0.25}}}\n"
    )
    arms = load_all_arms([str(a_path), str(b_path)])
    workload = load_workload(
        write(
            tmp_path / "w.jsonl",
            "\n".join(
                json.dumps({"question": f"q{i}", "answers": ["x"], "documents": ["x y"]}) for i in range(10)
            )
            + "\nbad\n",
        )
    )
    obs = []
    for i in range(10):
        obs.append(
            Observation(
                "slow",
                i + 1,
                True,
                ttft_ms=100.0 + i,
                e2e_ms=200.0 + i,
                tpot_ms=10.0,
                prompt_tokens=300,
                completion_tokens=11,
                timings_ms={"prompt": 1.0, "decode": 99.0},
                text="x",
                exact_match=1.0,
                f1=1.0,
                accuracy=1.0,
                answer_in_documents=True,
                answer_in_prompt=True,
            )
        )
        obs.append(
            Observation(
                "fast",
                i + 1,
                True,
                ttft_ms=10.0 + i,
                e2e_ms=50.0 + i,
                tpot_ms=4.0,
                prompt_tokens=80,
                cached_tokens=64,
                completion_tokens=11,
                compressed_tokens=5,
                timings_ms={"compression": 2.0, "decode": 40.0},
                text="y",
                exact_match=0.0,
                f1=0.0,
                accuracy=0.0,
                answer_in_documents=True,
                answer_in_prompt=i != 0,
            )
        )
    obs.append(Observation("fast", 11, False, error="400: too long"))
    result = RunResult(tuple(obs), {"slow": 2.0, "fast": 0.5}, 3.0)
    return build_report(arms, workload, LoadShape(concurrency=2), result, num_resamples=200)


def test_report_figures(tmp_path):
    report = _synthetic(tmp_path)
    assert report["ttft_ratio"] == pytest.approx(104.5 / 14.5)
    assert report["e2e_ratio"] == pytest.approx(204.5 / 54.5)
    assert report["retention"] == pytest.approx(0.9)
    assert report["num_skipped_lines"] == 1 and report["skipped_lines"][0]["line"] == 11
    fast = report["arms"]["fast"]
    assert (fast["num_requests"], fast["num_errors"], fast["errors"]) == (11, 1, ["400: too long"])
    assert fast["requests_per_s"] == 20.0 and fast["output_tokens_per_s"] == 220.0
    assert fast["cached_tokens_mean"] == 64 and fast["compressed_tokens_mean"] == 5
    assert list(fast["stage_ms_mean"]) == ["compression", "decode"]
    assert report["slow_exact_match"] == 1.0 and report["fast_f1"] == 0.0
    [comparison] = report["comparisons"]
    assert comparison["ttft_ms"]["median_difference"]["value"] == -90.0
    assert comparison["ttft_ms"]["significant"] is True
    text = format_text(report)
    assert "ttft_ratio 7.21  e2e_ratio 3.75  retention 0.900  (slow / fast)" in text
    assert "skipped 1 invalid workload line(s): 11 (not valid JSON" in text


def test_html_report_embeds_three_plots(tmp_path):
    page = render_html(_synthetic(tmp_path))
    assert page.count('src="data:image/png;base64,') == 3
    assert "Latency CDFs" in page and "Per-stage time" in page and "line 11:" in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install -y chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image, ImageStat

    page = tmp_path / "report.html"
    page.write_text(render_html(_synthetic(tmp_path)), encoding="utf-8")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=1280,2400",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    image = Image.open(shot).convert("RGB")
    assert image.size[0] >= 800 and image.size[1] >= 800
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, tables and plots, not a blank page
    assert max(ImageStat.Stat(image).stddev) > 20


# ---------------------------------------------------------------- against real servers


def test_request_body_merges_the_arm_overlay(tmp_path):
    [arm] = load_arms(
        str(write(tmp_path / "a.yaml", "request: {max_tokens: 3, ragspeed: {compression: false}}\n"))
    )
    workload = load_workload(
        write(
            tmp_path / "w.jsonl",
            json.dumps(
                {
                    "question": "q",
                    "answers": ["a"],
                    "documents": ["d"],
                }
            )
            + "\n",
        )
    )
    body = request_body(workload.items[0], arm)
    assert body["max_tokens"] == 3 and body["stream"] is True
    assert body["ragspeed"] == {"compression": False, "return_prompt": True}


def test_replay_against_a_running_server(transformers_server, tmp_path, shared_data):
    a = write(tmp_path / "plain.yaml", "engine: transformers\nrequest: {ragspeed: {compression: false}}\n")
    b = write(tmp_path / "again.yaml", "engine: transformers\n")
    arms = load_all_arms([str(a), str(b)])
    workload = load_workload(shared_data / "nq_dev.jsonl", limit=4, num_documents=2, max_tokens=4)
    urls = {arm.name: transformers_server.url for arm in arms}
    report = run_ab(
        arms, workload, LoadShape(concurrency=2, block_size=2, warmup=1), urls=urls, num_resamples=100
    )
    for name in ("plain", "again"):
        summary = report["arms"][name]
        assert (summary["num_requests"], summary["num_errors"]) == (4, 0)
        assert summary["ttft_ms"]["p50"]["value"] > 0
        assert summary["completion_tokens_mean"] == 4
        assert summary["retention"] == 1.0 and summary["retention_n"] == 4  # no compression: all kept
        assert summary["stage_ms_mean"]["engine_first_token"] > 0
    order = [o["arm"] for o in report["observations"]]
    assert order == ["plain"] * 2 + ["again"] * 2 + ["again"] * 2 + ["plain"] * 2  # AB, then BA


def test_the_progress_bar_counts_every_request_without_deprecated_click_calls(tmp_path, monkeypatch):
    # click.get_text_stream is deprecated in Click 8.5 and gone in 9: the bar writes to sys.stderr.
    arms = load_all_arms([str(write(tmp_path / "a.yaml", "engine: transformers\n"))])
    done = []

    async def replay(arms, urls, items, shape, on_done):
        for item in items:
            on_done(item)
            done.append(item)
        return "result"

    monkeypatch.setattr("ragspeed.ab.cli.replay", replay)
    monkeypatch.setattr("ragspeed.ab.cli.build_report", lambda arms, workload, shape, result, **_: result)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        result = run_ab(arms, Workload("w.jsonl", items=("x", "y", "z")), LoadShape(), urls={}, progress=True)
    assert (result, done) == ("result", ["x", "y", "z"])


def test_cli_refuses_a_bad_arm_before_starting_anything(tmp_path):
    bad = write(tmp_path / "bad.yaml", "engine: native\nspeculatve: ngram\n")
    result = subprocess.run(
        [sys.executable, "-m", "ragspeed", "ab", "--arm", str(bad), "--data", str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert f"{bad}:2: key 'speculatve': unknown option" in result.stderr


def test_cli_runs_one_arm_end_to_end(tiny_model, tmp_path):
    arm = write(tmp_path / "tiny.yaml", f"engine: transformers\nmodel: {tiny_model}\n")
    data = write(
        tmp_path / "w.jsonl",
        "\n".join(
            [
                json.dumps(
                    {
                        "question": "who?",
                        "answers": ["Ann"],
                        "documents": [{"title": "T", "text": "Ann did it."}],
                    }
                ),
                "oops",
                json.dumps({"messages": [{"role": "user", "content": "hello"}]}),
            ]
        )
        + "\n",
    )
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragspeed",
            "ab",
            "--arm",
            str(arm),
            "--data",
            str(data),
            "--max-tokens",
            "3",
            "--warmup",
            "1",
            "--json",
            str(out_json),
            "--html",
            str(out_html),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{data}:2: skipped: not valid JSON" in result.stderr
    report = json.loads(out_json.read_text())
    assert report["tiny_num_errors"] == 0 and report["arms"]["tiny"]["num_requests"] == 2
    assert report["num_skipped_lines"] == 1 and report["ttft_ratio"] == 1.0
    assert {"ttft_ratio", "e2e_ratio", "retention"} <= set(report)
    assert out_html.read_text().count("data:image/png;base64,") == 3
