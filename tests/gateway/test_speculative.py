"""Speculative decoding through the real server: `ragspeed serve --speculative draft|ngram` on
the bundled demo model and its distilled draft, against a server without speculation, over HTTP
with the official openai client; bad speculative configurations fail at start-up."""

from __future__ import annotations

import httpx
import openai
import pytest

from ragspeed.bench.launcher import ServerProcess
from ragspeed.bench.load import read_gauge

COMMON = [
    "--engine",
    "native",
    "--model",
    "ragspeed-demo",
    "--served-model-name",
    "demo",
    "--num-kv-cache-tokens",
    "8192",
    "--log-level",
    "warning",
]
MESSAGES = [
    {"role": "system", "content": "Answer by quoting the documents."},
    {
        "role": "user",
        "content": "The Eiffel Tower is a wrought-iron lattice tower in Paris. "
        "Quote the passage about the tower.",
    },
]


@pytest.fixture(scope="module")
def servers():
    plain = ServerProcess(COMMON).start()
    draft = ngram = None
    try:
        draft = ServerProcess(
            COMMON + ["--speculative", "draft", "--draft-model", "ragspeed-demo-draft"]
        ).start()
        ngram = ServerProcess(COMMON + ["--speculative", "ngram", "--num-speculative-tokens", "3"]).start()
        yield {"plain": plain, "draft": draft, "ngram": ngram}
    finally:
        for server in (plain, draft, ngram):
            if server is not None:
                server.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.mark.parametrize("speculative", ["draft", "ngram"])
def test_greedy_answers_are_those_of_the_server_without_speculation(servers, speculative):
    def answers(server) -> tuple[str, str, str]:
        client = _client(server)
        chat = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=48, temperature=0)
        text = client.completions.create(
            model="demo", prompt="The history of the city began", max_tokens=48, temperature=0
        )
        stream = client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=48, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return chat.choices[0].message.content, text.choices[0].text, streamed

    expected = answers(servers["plain"])
    assert answers(servers[speculative]) == expected
    assert expected[0] == expected[2] and all(expected)
    metrics = httpx.get(f"{servers[speculative].url}/metrics", timeout=10).text
    drafted = read_gauge(metrics, f"ragspeed_engine_spec_{speculative}_draft_tokens")
    accepted = read_gauge(metrics, f"ragspeed_engine_spec_{speculative}_accepted_tokens")
    assert drafted and drafted > 0 and 0 <= accepted <= drafted
    assert read_gauge(metrics, "ragspeed_engine_num_blocks_used") == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [
                "--speculative",
                "draft",
                "--draft-model",
                "ragspeed-demo-draft",
                "--draft-quantization",
                "int4",
            ],
            "unknown quantization 'int4'",
        ),
        (["--speculative", "medusa"], "unknown speculative method 'medusa'"),
    ],
)
def test_a_bad_speculative_configuration_fails_at_start_up(flags, message):
    server = ServerProcess(COMMON + flags)
    try:
        with pytest.raises(RuntimeError, match=message):
            server.start()
    finally:
        server.stop()
