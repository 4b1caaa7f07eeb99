"""The gateway end to end: the official openai client, the SDK and raw httpx against real servers
(greedy output equal to transformers' generate, the openai engine in front of a second server,
upstreams that are down, hung or die mid-stream). Bad input, the context check, /v1/models,
/metrics and hang-ups are tested in-process: test_inprocess_*.py."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragspeed.bench.launcher import ServerProcess
from ragspeed.gateway.client import AsyncRagspeedClient, RagspeedClient, RagspeedError

QUESTION = "Who received the first Nobel Prize in Physics?"
DOCUMENTS = [
    {
        "title": "Nobel Prize in Physics",
        "text": "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen.",
    },
    "John Bardeen is the only laureate to win the prize twice.",
]


def hf_greedy(model_dir, token_ids: list[int], max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([token_ids]),
        attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, len(token_ids) :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def client(transformers_server):
    return openai.OpenAI(base_url=f"{transformers_server.url}/v1", api_key="unused")


def test_openai_client_chat_with_documents(client):
    completion = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=6,
        temperature=0,
        extra_body={"documents": DOCUMENTS},
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert completion.model == "tiny"
    usage = completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # the transformers baseline has no cache
    ragspeed = completion.model_extra["ragspeed"]
    assert set(ragspeed["timings_ms"]) >= {"segments", "prompt", "engine_first_token", "decode"}
    assert ragspeed["num_static_tokens"] > 0
    # The documents made it into the prompt: the same request without them is shorter.
    bare = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=1,
        temperature=0,
    )
    assert usage.prompt_tokens > bare.usage.prompt_tokens + 30


def test_openai_client_streams_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0
    )
    assert text == whole.choices[0].message.content


def test_greedy_chat_equals_transformers_generate(client, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    completion = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    token_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert completion.usage.prompt_tokens == len(token_ids)
    assert completion.choices[0].message.content == hf_greedy(tiny_model, token_ids, 12)


def test_greedy_text_completion_equals_transformers_generate(client, tiny_model):
    completion = client.completions.create(
        model="tiny", prompt="The first Nobel Prize", max_tokens=10, temperature=0
    )
    token_ids = AutoTokenizer.from_pretrained(tiny_model).encode("The first Nobel Prize")
    assert completion.choices[0].text == hf_greedy(tiny_model, token_ids, 10)


def test_documents_between_markers_equal_documents_field(client):
    text_docs = "".join(f"<document>{d if isinstance(d, str) else d['text']}</document>" for d in DOCUMENTS)
    plain = [d if isinstance(d, str) else d["text"] for d in DOCUMENTS]
    marked = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"{text_docs}\n{QUESTION}"}],
        max_tokens=4,
        temperature=0,
    )
    fielded = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        extra_body={"documents": plain},
    )
    assert marked.usage.prompt_tokens == fielded.usage.prompt_tokens
    assert marked.choices[0].message.content == fielded.choices[0].message.content


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
    )
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_sdk_sync_and_async(transformers_server):
    with RagspeedClient(transformers_server.url) as sdk:
        assert sdk.models() == ["tiny"]
        result = sdk.chat(
            QUESTION, documents=DOCUMENTS, system="Answer briefly.", max_tokens=5, temperature=0
        )
        assert result.usage.completion_tokens == 5 and result.finish_reason == "length"
        assert result.ttft_ms is not None and result.ttft_ms <= result.e2e_ms
        pieces = list(
            sdk.chat_stream(
                QUESTION, documents=DOCUMENTS, system="Answer briefly.", max_tokens=5, temperature=0
            )
        )
        assert "".join(p.text for p in pieces) == result.text
        assert pieces[-1].result.usage.prompt_tokens == result.usage.prompt_tokens

    async def run_async():
        async with AsyncRagspeedClient(transformers_server.url) as sdk:
            result = await sdk.chat(QUESTION, max_tokens=3, temperature=0)
            streamed = [p async for p in sdk.chat_stream(QUESTION, max_tokens=3, temperature=0)]
            return result, streamed

    result, streamed = asyncio.run(run_async())
    assert "".join(p.text for p in streamed) == result.text
    with RagspeedClient(transformers_server.url) as sdk, pytest.raises(RagspeedError) as err:
        sdk.chat(QUESTION, model="nope")
    assert err.value.status_code == 404 and err.value.param == "model"


# The openai engine: a ragspeed gateway in front of a second real ragspeed server.


def test_openai_engine_forwards_to_upstream(gateway_server, client, tiny_model):
    via = openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    direct = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    forwarded = via.chat.completions.create(
        model="tiny-via-gateway", messages=messages, max_tokens=8, temperature=0
    )
    assert forwarded.choices[0].message.content == direct.choices[0].message.content
    assert forwarded.usage.prompt_tokens == direct.usage.prompt_tokens
    stream = via.chat.completions.create(
        model="tiny-via-gateway",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == direct.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == direct.usage.completion_tokens


def test_openai_engine_passes_upstream_rejections(gateway_server):
    response = httpx.post(
        f"{gateway_server.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "top_p": 0.5, "seed": 1, "stop": ["x"]},
    )
    assert response.status_code == 200


def _silent_listener() -> tuple[socket.socket, int]:
    """A TCP server that accepts connections and never answers: a hung upstream."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.extend(sock.accept() for _ in range(8)), daemon=True).start()
    return sock, sock.getsockname()[1]


def test_upstream_down_is_502_and_hung_is_504(tiny_model):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]  # closed again: nothing listens there
    hung, hung_port = _silent_listener()
    try:
        with (
            ServerProcess(
                [
                    "--engine",
                    "openai",
                    "--model",
                    str(tiny_model),
                    "--upstream",
                    f"http://127.0.0.1:{dead_port}",
                ]
            ) as dead,
            ServerProcess(
                [
                    "--engine",
                    "openai",
                    "--model",
                    str(tiny_model),
                    "--read-timeout-s",
                    "1",
                    "--upstream",
                    f"http://127.0.0.1:{hung_port}",
                ]
            ) as slow,
        ):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            response = httpx.post(f"{dead.url}/v1/chat/completions", json=body, timeout=30)
            assert response.status_code == 502
            assert f"127.0.0.1:{dead_port}" in response.json()["error"]["message"]
            response = httpx.post(
                f"{slow.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
            )
            assert response.status_code == 504
            assert "timed out" in response.json()["error"]["message"]
    finally:
        hung.close()


def _dying_upstream() -> tuple[socket.socket, int]:
    """An upstream that starts a stream, sends one token, then drops the connection."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            request = conn.recv(65536)
            # Chat requests go upstream as chat (upstream_api: chat), text ones as completions.
            if request.startswith(b"POST /v1/chat/completions"):
                chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": null}]}\n\n'
            else:
                chunk = b'data: {"choices": [{"index": 0, "text": "Hello", "finish_reason": null}]}\n\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + f"{len(chunk):x}\r\n".encode()
                + chunk
                + b"\r\n"
            )
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return sock, sock.getsockname()[1]


def test_upstream_failing_mid_stream_ends_with_an_error_event(tiny_model):
    dying, port = _dying_upstream()
    try:
        with ServerProcess(
            ["--engine", "openai", "--model", str(tiny_model), "--upstream", f"http://127.0.0.1:{port}"]
        ) as gateway:
            with httpx.stream(
                "POST",
                f"{gateway.url}/v1/chat/completions",
                timeout=30,
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True},
            ) as response:
                assert response.status_code == 200
                lines = [line for line in response.iter_lines() if line.startswith("data:")]
            assert '"Hello"' in lines[1]
            assert "upstream" in json.loads(lines[-2][5:])["error"]["message"]
            assert lines[-1] == "data: [DONE]"
    finally:
        dying.close()


def test_a_start_that_fails_exits_non_zero_with_the_error_on_one_line(tiny_model):
    def serve(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ragspeed", "serve", "--port", "0", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    # A model that is nowhere: the engine's start fails after the server is up.
    started = time.monotonic()
    nowhere = serve("--engine", "openai", "--model", "no-such-model", "--upstream", "http://127.0.0.1:9")
    assert nowhere.returncode == 1 and time.monotonic() - started < 60
    assert "Error: the engine failed to start: ModelUnavailableError: model 'no-such-model'" in nowhere.stderr
    assert "Traceback" not in nowhere.stderr
    # An option the backend refuses: before anything starts.
    refused = serve("--engine", "openai", "--model", str(tiny_model))
    assert refused.returncode == 2
    assert "engine openai: the openai engine needs at least one upstream URL" in refused.stderr


def test_the_tokenizer_takes_the_names_the_model_takes(tiny_model, tmp_path):
    from ragspeed.engine.native.loading.model_zoo import ModelUnavailableError, resolve_tokenizer

    assert resolve_tokenizer(None, tiny_model) == str(tiny_model)
    assert resolve_tokenizer(str(tiny_model), "elsewhere") == str(tiny_model)
    with pytest.raises(ModelUnavailableError, match="not a zoo name"):
        resolve_tokenizer("no-such-tokenizer", tiny_model)
