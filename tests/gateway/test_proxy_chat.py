"""The proxy forwards chat requests faithfully: the chat body built for the upstream on literal
requests (gateway.upstream_chat), and end to end, the official openai client in front of
`ragspeed serve --engine openai` in front of a second real ragspeed on the default model (and,
where it is installed, llama.cpp's server)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ragspeed.bench.launcher import ServerProcess, free_port
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME, ZOO
from ragspeed.gateway.prompt import render_documents, split_segments
from ragspeed.gateway.protocol import ChatCompletionRequest
from ragspeed.gateway.upstream_chat import upstream_chat_body
from tests.real_model import NOBEL_DOCUMENT, default_model_cache

START, END = "<document>", "</document>"
SYSTEM = "Answer from the documents."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def body_of(request: dict, documents=None) -> dict:
    """The upstream chat body of the wire request `request`, its documents uncompressed (or
    `documents`, standing for what compression made of them)."""
    req = ChatCompletionRequest.model_validate(request)
    segments = split_segments(req.messages, req.documents, start_marker=START, end_marker=END)
    final = segments.documents if documents is None else documents
    return upstream_chat_body(req, segments, final, start_marker=START, end_marker=END)


def test_documents_go_into_the_system_message_after_the_static_prompt():
    body = body_of(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Who won? {START}Bardeen won twice.{END}"},
            ],
            "documents": [{"title": "Nobel", "text": NOBEL_DOCUMENT}],
            "ragspeed": {"return_prompt": True},
        }
    )
    system = f"{SYSTEM}\n\nDocuments:\n\n[1] Nobel\n{NOBEL_DOCUMENT}\n\n[2]\nBardeen won twice."
    # model, documents and ragspeed are the gateway's; the user's span is cut out of the message.
    assert body == {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Who won?"}]
    }


def test_the_static_prompt_is_the_same_leading_bytes_whatever_the_documents():
    request = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": "Cite documents by number."},
            {"role": "user", "content": "Q?"},
        ]
    }
    static = "You are terse.\n\nCite documents by number."
    contents = [
        body_of({**request, "documents": documents})["messages"][0]["content"]
        for documents in (["one"], ["two", "three"], [])
    ]
    # The leading system and developer messages become one system message: the static prompt,
    # then the documents as assemble_prompt renders them (compressed ones, as given).
    assert contents == [
        f"{static}\n\nDocuments:\n\n[1]\none",
        f"{static}\n\nDocuments:\n\n[1]\ntwo\n\n[2]\nthree",
        static,
    ]
    (compressed,) = split_segments([], ["tw"], start_marker=START, end_marker=END).documents
    body = body_of({**request, "documents": ["two words"]}, documents=(compressed,))
    assert body["messages"][0]["content"] == f"{static}\n\n{render_documents([compressed])}"


def test_without_a_system_message_the_documents_are_a_system_message_of_their_own():
    body = body_of({"messages": [{"role": "user", "content": "Q?"}], "documents": ["d"]})
    assert body["messages"] == [
        {"role": "system", "content": "Documents:\n\n[1]\nd"},
        {"role": "user", "content": "Q?"},
    ]
    plain = body_of({"messages": [{"role": "user", "content": "Q?"}]})
    assert plain == {"messages": [{"role": "user", "content": "Q?"}]}


def test_every_other_field_passes_through_as_sent():
    request = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}},
        },
        "temperature": 0.3,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100},
        "seed": 7,
        "stop": "\n\n",
        "logprobs": True,
        "top_logprobs": 3,
        "max_completion_tokens": 20,
        "structured_outputs": {"json": {"type": "object"}},
        "guided_regex": "[a-z]+",
        "chat_template_kwargs": {"enable_thinking": False},  # vendor fields, in model_extra
        "mirostat_tau": 5.0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ragspeed": {"compression": False},
    }
    body = body_of(request)
    consumed = {"model", "n", "stream", "stream_options", "ragspeed"}
    expected = {k: v for k, v in request.items() if k not in consumed}
    expected["stop"] = ["\n\n"]  # the schema's one normal form of a stop string
    assert body == expected
    assert list(body["response_format"]["json_schema"]) == ["name", "schema"]  # the alias, as sent
    # Defaults the client did not send are not invented (an upstream's may differ).
    assert "top_p" not in body_of({"messages": [{"role": "user", "content": "x"}]})


def test_messages_with_tool_calls_tool_answers_and_parts_are_kept_whole():
    messages = [
        {"role": "system", "content": SYSTEM, "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}], "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
            "refusal": None,
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"And here? {START}Lyon is 20 C.{END}"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "text", "text": " Be brief. "},
            ],
        },
    ]
    body = body_of({"messages": messages, "tools": [WEATHER_TOOL]})
    assert body["messages"][0] == {
        "role": "system",
        "content": f"{SYSTEM}\n\nDocuments:\n\n[1]\nLyon is 20 C.",
    }
    assert body["messages"][1:4] == messages[1:4]
    # The span is cut out of the part that held it; the other parts stay as sent.
    assert body["messages"][4]["content"] == [
        {"type": "text", "text": "And here?"},
        *messages[4]["content"][1:],
    ]


# End to end: openai client -> ragspeed --engine openai -> ragspeed on the default model.


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    cache = default_model_cache(tmp_path_factory)
    with ServerProcess(
        ["--served-model-name", "smol", "--max-num-seqs", "4"], env={"RAGSPEED_CACHE_DIR": str(cache)}
    ) as server:
        yield server


@pytest.fixture(scope="module")
def proxy(upstream, tmp_path_factory):
    cache = default_model_cache(tmp_path_factory)
    args = ["--engine", "openai", "--upstream", upstream.url, "--upstream-model", "smol"]
    args += ["--served-model-name", "proxy", "--compression-methods", "identity"]
    args += ["--compression-default-method", "identity", "--no-enable-retrieval"]
    with ServerProcess(args, env={"RAGSPEED_CACHE_DIR": str(cache)}) as server:
        yield server


@pytest.fixture(scope="module")
def clients(upstream, proxy) -> tuple[openai.OpenAI, openai.OpenAI]:
    return (
        openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0),
        openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="unused", max_retries=0),
    )


QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Who received the first Nobel Prize in Physics?"},
]


def test_plain_chat_through_the_proxy_is_the_upstreams_answer(clients):
    via, direct = clients
    asked = {"messages": QUESTION, "max_tokens": 12, "temperature": 0}
    expected = direct.chat.completions.create(model="smol", **asked)
    answer = via.chat.completions.create(model="proxy", **asked)
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.model == "proxy"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        expected.usage.prompt_tokens,
        expected.usage.completion_tokens,
    )
    chunks = list(
        via.chat.completions.create(
            model="proxy", stream=True, stream_options={"include_usage": True}, **asked
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == expected.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens


def test_documents_reach_the_upstream_in_its_system_message(clients):
    via, direct = clients
    # Asked directly with the documents written into the system message as the proxy places
    # them, the upstream renders the same prompt: the same count of prompt tokens, the same answer.
    answer = via.chat.completions.create(
        model="proxy",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        extra_body={"documents": [NOBEL_DOCUMENT]},
    )
    expected = direct.chat.completions.create(
        model="smol",
        messages=[
            {"role": "system", "content": f"{SYSTEM}\n\nDocuments:\n\n[1]\n{NOBEL_DOCUMENT}"},
            QUESTION[1],
        ],
        max_tokens=24,
        temperature=0,
    )
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert "Röntgen" in answer.choices[0].message.content
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens


def test_a_vendor_field_reaches_the_upstream(clients, upstream):
    via, direct = clients
    asked = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 24, "temperature": 0}
    natural = direct.chat.completions.create(model="smol", **asked)
    assert natural.choices[0].finish_reason == "stop"  # it ends by itself before 24 tokens
    # vLLM's ignore_eos, as sent: the upstream writes all 24 tokens.
    forced = via.chat.completions.create(model="proxy", extra_body={"ignore_eos": True}, **asked)
    assert (forced.choices[0].finish_reason, forced.usage.completion_tokens) == ("length", 24)
    assert forced.choices[0].message.content.startswith(natural.choices[0].message.content)
    # A field ragspeed itself does not honour (undeclared, in model_extra) goes upstream too: the
    # upstream ragspeed refuses it, and its 400 comes back through the proxy.
    with pytest.raises(openai.BadRequestError) as refused:
        via.chat.completions.create(model="proxy", extra_body={"best_of": 2}, **asked)
    message = refused.value.body["message"]
    assert message.startswith(f"upstream {upstream.url}/v1 answered 400") and "best_of" in message


def test_logprobs_come_back_as_the_upstream_sent_them(clients):
    via, direct = clients
    asked = {"messages": QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    expected = direct.chat.completions.create(model="smol", **asked).choices[0].logprobs.content
    answer = via.chat.completions.create(model="proxy", **asked).choices[0].logprobs.content
    assert [(t.token, len(t.top_logprobs)) for t in answer] == [(t.token, 2) for t in expected]
    chunks = via.chat.completions.create(model="proxy", stream=True, **asked)
    streamed = [
        t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.token for t in expected]


# Tools and structured output are the upstream's to honour; the proxy forwards them.


def test_a_named_tool_choice_comes_back_as_a_tool_call(clients):
    via, _ = clients
    asked = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
        "temperature": 0,
    }
    answer = via.chat.completions.create(model="proxy", **asked)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert answer.choices[0].finish_reason == "tool_calls"
    # Streamed, the upstream's tool-call deltas come through and add up to the same call.
    deltas = [
        d
        for c in via.chat.completions.create(model="proxy", stream=True, **asked)
        if c.choices
        for d in c.choices[0].delta.tool_calls or ()
    ]
    assert {d.function.name for d in deltas if d.function.name} == {"get_weather"}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_a_json_object_response_format_comes_back_as_json(clients):
    via, _ = clients
    answer = via.chat.completions.create(
        model="proxy",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


# In front of llama.cpp's server (llama-cpp-python[server]; not a dependency of the project).


def _llama_cpp_python() -> str | None:
    """An interpreter whose `llama_cpp.server` imports: RAGSPEED_TEST_LLAMA_CPP_PYTHON (e.g. a
    venv of its own: it compiles for minutes), else this one where it has it."""
    named = os.environ.get("RAGSPEED_TEST_LLAMA_CPP_PYTHON")
    if named:
        return named
    try:  # the [server] extra's own modules too: llama_cpp.server is found without them
        found = all(
            importlib.util.find_spec(name)
            for name in ("llama_cpp.server", "sse_starlette", "starlette_context")
        )
    except ImportError:
        return None
    return sys.executable if found else None


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory):
    python = _llama_cpp_python()
    if python is None:
        pytest.skip("llama-cpp-python[server] is not installed (nor named by RAGSPEED_TEST_LLAMA_CPP_PYTHON)")
    port = free_port()
    gguf = ZOO[DEFAULT_MODEL_NAME].source_file()
    log = tmp_path_factory.mktemp("llama-cpp") / "server.log"
    command = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smol-llama"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "llama.cpp's server did not start in 120 s"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def llama_cpp_clients(llama_cpp_server, tmp_path_factory):
    cache = default_model_cache(tmp_path_factory)  # the proxy's tokenizer
    args = ["--engine", "openai", "--upstream", llama_cpp_server, "--upstream-model", "smol-llama"]
    args += ["--served-model-name", "proxy", "--compression-methods", "identity"]
    args += ["--compression-default-method", "identity", "--no-enable-retrieval"]
    with ServerProcess(args, env={"RAGSPEED_CACHE_DIR": str(cache)}) as proxy:
        yield (
            openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0),
            openai.OpenAI(base_url=f"{llama_cpp_server}/v1", api_key="unused", max_retries=0),
        )


def test_in_front_of_llama_cpp_documents_and_json_pass(llama_cpp_clients):
    via, direct = llama_cpp_clients
    answer = via.chat.completions.create(
        model="proxy",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        extra_body={"documents": [NOBEL_DOCUMENT]},
    )
    expected = direct.chat.completions.create(
        model="smol-llama",
        messages=[
            {"role": "system", "content": f"{SYSTEM}\n\nDocuments:\n\n[1]\n{NOBEL_DOCUMENT}"},
            QUESTION[1],
        ],
        max_tokens=24,
        temperature=0,
    )
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    # llama.cpp honours response_format with a grammar of its own; the proxy only forwards it.
    formatted = via.chat.completions.create(
        model="proxy",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    assert isinstance(json.loads(formatted.choices[0].message.content), dict)
