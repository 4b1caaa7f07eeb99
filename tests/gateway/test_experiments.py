"""Live A/B experiments: the experiment file, sticky weighted assignment, and a real server."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from ragspeed.bench.launcher import ServerProcess
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import HOLDOUT_ARM, ArmError, ArmHints, ExperimentArm, LiveExperiment, load_experiment
from ragspeed.gateway.protocol import ChatCompletionRequest

REPO = Path(__file__).resolve().parents[2]

EXPERIMENT = """\
name: exp1
sticky_by: user
holdout: {share: 0.1}
arms:
  a: {weight: 3}
  b: {weight: 1, ragspeed: {compression: {rate: 0.5}}}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def experiment(tmp_path) -> LiveExperiment:
    return LiveExperiment(load_experiment(write(tmp_path / "e.yaml", EXPERIMENT)), seed=0)


def test_weighted_sticky_split_with_holdout(experiment):
    counts = Counter(experiment.assign(f"user-{i}", ArmHints()).name for i in range(1000))
    assert counts == {"a": 674, "b": 249, HOLDOUT_ARM: 77}
    # Sticky: the same caller always gets the same arm.
    assert {experiment.assign("user-7", ArmHints()).name for _ in range(20)} == {experiment.assign("user-7", ArmHints()).name}
    summary = experiment.summary()
    assert (summary["arms"]["a"]["share"], summary["arms"]["b"]["share"], summary["arms"][HOLDOUT_ARM]["share"]) \
        == (0.675, 0.225, 0.1)
    assert summary["arms"]["a"]["assigned"] == 674 + 21


def test_sticky_by_api_key_and_override(tmp_path):
    spec = load_experiment(write(tmp_path / "k.yaml", "sticky_by: api_key\narms: {x: {weight: 1}, y: {weight: 1}}\n"))
    assert spec.name == "k" and spec.holdout_share == 0.0
    live = LiveExperiment(spec)
    by_key = {live.assign(f"u{i}", ArmHints(api_key_hash="h1")).name for i in range(10)}
    assert len(by_key) == 1  # the key decides, not the user field
    assert live.assign("u", ArmHints(override="y")).name == "y"
    with pytest.raises(APIError) as exc:
        live.assign("u", ArmHints(override="z"))
    assert (exc.value.status_code, exc.value.param) == (400, "x-ragspeed-arm")
    with pytest.raises(APIError, match="unknown arm 'holdout'"):
        live.assign("u", ArmHints(override=HOLDOUT_ARM))  # no holdout in this experiment


def test_arm_options_win_over_the_client():
    arm = ExperimentArm("b", 1.0, ragspeed={"compression": {"rate": 0.5}})
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "q"}],
                                                "ragspeed": {"compression": False, "return_prompt": True}})
    applied = arm.apply(req)
    assert applied.ragspeed.compression.rate == 0.5 and applied.ragspeed.return_prompt is True
    assert req.ragspeed.compression is False  # the request itself is not mutated


@pytest.mark.parametrize("text, line, message", [
    ("arms:\n  a: {weight: 0}\n  b: {weight: 0}\n", 1, "key 'arms': the arms' weights must sum to a positive number"),
    ("arms:\n  a:\n    weight: -1\n", 3, "key 'arms.a.weight': must lie in [0.0, inf]"),
    ("arms:\n  a:\n    weight: lots\n", 3, "key 'arms.a.weight': must be a number"),
    ("name: e\nsticky: user\narms: {a: {}}\n", 2, "key 'sticky': unknown key"),
    ("sticky_by: cookie\narms: {a: {}}\n", 1, "key 'sticky_by': must be one of user, api_key, none"),
    ("holdout: {share: 0.9}\narms: {a: {}}\n", 1, "key 'holdout.share': must lie in [0.0, 0.5]"),
    ("arms:\n  a:\n    weigth: 1\n", 3, "key 'arms.a.weigth': unknown key"),
    ("arms:\n  a:\n    ragspeed:\n      compression: {rate: 3}\n", 4,
     "key 'arms.a.ragspeed.compression.rate': Input should be less than or equal to 1"),
    ("arms:\n  a:\n    engine:\n      block_size: 0\n", 4, "key 'arms.a.engine.block_size'"),
    ("arms:\n  holdout: {}\n", 2, "'holdout' is reserved"),
    ("arms: []\n", 1, "key 'arms': must map arm names"),
])
def test_bad_experiment_files(tmp_path, text, line, message):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ArmError) as exc:
        load_experiment(path, {})
    assert str(exc.value).startswith(f"{path}:{line}: ")
    assert message in str(exc.value)


def test_example_live_experiment_loads():
    spec = load_experiment(REPO / "examples/ab/live_experiment.yaml")
    assert (spec.name, [a.name for a in spec.arms], spec.holdout_share) == ("compression-4x", ["control", "compressed"], 0.05)


@pytest.fixture(scope="module")
def experiment_server(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("exp") / "live.yaml"
    write(path, "name: live\nsticky_by: user\narms:\n  control: {weight: 1, ragspeed: {compression: false}}\n"
                "  short:\n    weight: 1\n    engine: {max_model_len: 32}\n")
    with ServerProcess(["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny",
                        "--experiment", str(path)]) as server:
        yield server


def _chat(server, content: str, user: str | None = None, arm: str | None = None) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}
    if user:
        body["user"] = user
    headers = {"x-ragspeed-arm": arm} if arm else {}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_live_server_splits_and_reports(experiment_server):
    server = experiment_server
    arms = []
    for i in range(8):
        response = _chat(server, "hi", user=f"user-{i}")
        assert response.status_code == 200, response.text
        assert response.headers["x-ragspeed-arm"] == response.json()["ragspeed"]["arm"]
        arms.append(response.json()["ragspeed"]["arm"])
    assert set(arms) == {"control", "short"}
    assert _chat(server, "hi", user="user-3").json()["ragspeed"]["arm"] == arms[3]  # sticky
    # The arm that owns an engine with a 32-token context refuses a long prompt; the control serves it.
    long = "the history of the city " * 12
    refused = _chat(server, long, arm="short")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert _chat(server, long, arm="control").status_code == 200
    bad = _chat(server, "hi", arm="nope")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-ragspeed-arm"

    summary = httpx.get(f"{server.url}/v1/experiments/live", timeout=10).json()
    control, short = summary["arms"]["control"], summary["arms"]["short"]
    assert control["assigned"] == arms.count("control") + (arms[3] == "control") + 1
    assert short["completed"] == arms.count("short") + (arms[3] == "short")
    assert set(control["ttft_ms"]) == {"p50", "p90", "p99"} and control["e2e_ms"]["p50"] > 0
    assert httpx.get(f"{server.url}/v1/experiments", timeout=10).json()["data"][0]["name"] == "live"
    missing = httpx.get(f"{server.url}/v1/experiments/other", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "experiment_not_found"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'ragspeed_e2e_request_latency_seconds_count{arm="short",model="tiny"}' in metrics


def test_serve_refuses_a_bad_experiment_file(tiny_model, tmp_path):
    path = write(tmp_path / "bad.yaml", "arms:\n  a: {weight: 0}\n")
    server = ServerProcess(["--engine", "transformers", "--model", str(tiny_model), "--experiment", str(path)],
                           ready_timeout_s=60)
    with pytest.raises(RuntimeError) as exc:
        server.start()
    server.stop()
    assert f"{path}:1: key 'arms': the arms' weights must sum to a positive number" in str(exc.value)
