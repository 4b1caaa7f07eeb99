"""A live A/B experiment in-process, over fake engines: sticky arm assignment, the arm in the
body and the `x-ragspeed-arm` header, an arm with an engine of its own, the override header,
the summary endpoints and per-arm /metrics; a bad experiment file refused at app creation."""

from __future__ import annotations

import pytest

from ragspeed.gateway.app import create_app
from ragspeed.gateway.settings import ConfigError
from tests.gateway.inprocess import SERVED_MODEL, fake_settings, metric, serve

pytestmark = pytest.mark.anyio

EXPERIMENT = (
    "name: live\nsticky_by: user\narms:\n  control: {weight: 1, ragspeed: {compression: false}}\n"
    "  short:\n    weight: 1\n    engine: {max_model_len: 32}\n"
)


@pytest.fixture
def experiment_file(tmp_path):
    path = tmp_path / "live.yaml"
    path.write_text(EXPERIMENT, encoding="utf-8")
    return path


async def _chat(client, content: str, user: str | None = None, arm: str | None = None):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0}
    if user:
        body["user"] = user
    headers = {"x-ragspeed-arm": arm} if arm else {}
    return await client.post("/v1/chat/completions", json=body, headers=headers)


async def test_live_server_splits_and_reports(fake, experiment_file):
    async with serve(fake_settings(experiment=str(experiment_file))) as client:
        main, short_engine = fake.engines
        assert (main.max_model_len, short_engine.max_model_len) == (4096, 32)
        arms = []
        for i in range(8):
            response = await _chat(client, "hi", user=f"user-{i}")
            assert response.status_code == 200, response.text
            assert response.headers["x-ragspeed-arm"] == response.json()["ragspeed"]["arm"]
            arms.append(response.json()["ragspeed"]["arm"])
        assert set(arms) == {"control", "short"}
        # Each arm's requests went to its own engine.
        assert len(short_engine.requests) == arms.count("short")
        assert len(main.requests) == arms.count("control")
        sticky = await _chat(client, "hi", user="user-3")
        assert sticky.json()["ragspeed"]["arm"] == arms[3]
        # The arm that owns an engine with a 32-token context refuses a long prompt; the control serves it.
        long = "the history of the city " * 12
        refused = await _chat(client, long, arm="short")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        served = await _chat(client, long, arm="control")
        assert served.status_code == 200 and served.headers["x-ragspeed-arm"] == "control"
        bad = await _chat(client, "hi", arm="nope")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-ragspeed-arm"

        summary = (await client.get("/v1/experiments/live")).json()
        listed = (await client.get("/v1/experiments")).json()
        missing = await client.get("/v1/experiments/other")
        metrics = (await client.get("/metrics")).text
    control, short = summary["arms"]["control"], summary["arms"]["short"]
    assert control["assigned"] == arms.count("control") + (arms[3] == "control") + 1
    assert short["completed"] == arms.count("short") + (arms[3] == "short")
    assert set(control["ttft_ms"]) == {"p50", "p90", "p99"} and control["e2e_ms"]["p50"] > 0
    assert listed["data"][0]["name"] == "live"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "experiment_not_found"
    assert metric(
        metrics, "ragspeed_e2e_request_latency_seconds_count", arm="short", model=SERVED_MODEL
    ) == arms.count("short") + (arms[3] == "short")
    assert fake.engines[0].shut_down and fake.engines[1].shut_down  # both stopped with the app


async def test_experiment_endpoints_without_an_experiment(fake):
    async with serve(fake_settings()) as client:
        listed = (await client.get("/v1/experiments")).json()
        missing = await client.get("/v1/experiments/live")
        plain = await _chat(client, "hi", arm="control")  # no experiment: the header means nothing
    assert listed == {"object": "list", "data": []}
    assert missing.json()["error"] == {
        "message": "no experiment named 'live' runs on this server",
        "type": "not_found_error",
        "param": "name",
        "code": "experiment_not_found",
    }
    assert plain.headers["x-ragspeed-arm"] == "default"


def test_a_bad_experiment_file_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("arms:\n  a: {weight: 0}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        create_app(fake_settings(experiment=str(path)))
    assert (
        str(exc.value) == f"experiment: {path}:1: key 'arms': the arms' weights must sum to a positive number"
    )
