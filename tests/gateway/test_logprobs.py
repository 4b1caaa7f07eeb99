"""Logprobs over HTTP with the official openai client: chat (`logprobs`, `top_logprobs`) and
legacy completions (`logprobs: int`), streamed and whole, against a real native-engine server."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from ragspeed.bench.launcher import ServerProcess

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def native_server(tiny_model):
    with ServerProcess(
        [
            "--engine",
            "native",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "512",
            "--num-kv-cache-tokens",
            "2048",
            "--log-level",
            "warning",
            # streamed and whole compared to 1e-5: one rounding for every batch shape, and one
            # for prefill and decode (auto's int8 rounds activations in decode products only)
            "--dtype",
            "float32",
            "--quantization",
            "none",
        ]
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(native_server):
    return openai.OpenAI(base_url=f"{native_server.url}/v1", api_key="unused")


def _check_entry(entry, num_top):
    assert isinstance(entry.token, str)
    assert entry.bytes == list(entry.token.encode("utf-8"))
    assert entry.logprob <= 0.0 and math.exp(entry.logprob) <= 1.0
    tops = entry.top_logprobs
    assert len(tops) == num_top
    assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
    for top in tops:
        assert top.bytes == list(top.token.encode("utf-8")) and math.exp(top.logprob) <= 1.0
    # greedy: the sampled token is the most likely one
    assert (tops[0].token, tops[0].logprob) == (entry.token, entry.logprob)


def test_chat_logprobs_whole_and_streamed_agree(client):
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    for entry in content:
        _check_entry(entry, 3)

    streamed = []
    text = ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == whole.choices[0].message.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in content
    ]


def test_logprobs_without_alternatives_and_off_by_default(client):
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    assert [e.top_logprobs for e in out.choices[0].logprobs.content] == [[]] * out.usage.completion_tokens
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, stream=True
    ):
        assert not chunk.choices or chunk.choices[0].logprobs is None


def test_legacy_completions_logprobs(client):
    kwargs = dict(
        model="tiny",
        prompt="Paris is the capital of",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert math.exp(logprob) <= 1.0
        assert top[token] == logprob and max(top.values()) == logprob  # greedy: the best
        assert 1 <= len(top) <= 3  # two alternatives plus the sampled token, when not among them
    streamed = []
    for chunk in client.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.tokens)
    assert streamed == lp.tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": "yes please"}, "logprobs"),
    ],
)
def test_bad_chat_logprobs_are_400_naming_the_parameter(client, native_server, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **body)
    assert err.value.status_code == 400 and err.value.param == param
    assert param in err.value.message
    assert httpx.get(f"{native_server.url}/healthz").status_code == 200


@pytest.mark.parametrize("value", [21, -1])
def test_bad_completion_logprobs_are_400(native_server, value):
    response = httpx.post(
        f"{native_server.url}/v1/completions",
        timeout=30,
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": value},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logprobs"
