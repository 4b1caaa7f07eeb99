"""The openai backend's forwarding path: the SSE readers (completions and chat), and real round
trips to the instant upstream (one pooled connection, bursts as one delta, usage on the last)
and to a scripted chat server (the chat body as sent, tool-call deltas and logprobs back)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from ragspeed.bench.instant_upstream import PROMPT_TOKENS, InstantUpstream
from ragspeed.engine.backends.remote.openai_backend import OpenAIEngine, UpstreamStream, chat_body
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import EngineError, GenerationRequest, SamplingParams, UpstreamError

STREAM = (
    b'data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}]}\n\n'
    b'data: {"choices":[{"index":0,"text":"lo","finish_reason":null}]}\r\n\r\n'
    b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
    b": a comment\n\n"
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":3}}}\n\n'
    b"data: [DONE]\n\n"
    b'data: {"choices":[{"index":0,"text":"after done","finish_reason":null}]}\n\n'
)


def test_one_read_of_many_events_is_one_text_and_the_usage_comes_last():
    stream = UpstreamStream("http://u/v1")
    assert stream.feed(STREAM).text == "Hello"
    final = stream.final_delta()
    assert (final.text, final.finish_reason) == ("", "length")
    assert (final.num_prompt_tokens, final.num_cached_tokens, final.num_completion_tokens) == (5, 3, 2)


@pytest.mark.parametrize("cut", [1, 7, 40, 70, 71, 150])
def test_events_split_across_reads_come_out_whole(cut):
    stream = UpstreamStream("http://u/v1")
    texts = [stream.feed(STREAM[:cut]).text, stream.feed(STREAM[cut:]).text, stream.feed(b"\n").text]
    assert "".join(texts) == "Hello"
    assert stream.final_delta().num_completion_tokens == 2


def test_a_stream_without_usage_or_finish_ends_as_stop():
    stream = UpstreamStream("http://u/v1")
    assert stream.feed(b'data: {"choices":[{"text":"x"}]}').text == ""  # no newline yet: held
    assert stream.feed(b"\n").text == "x"
    final = stream.final_delta()
    assert (final.finish_reason, final.num_completion_tokens) == ("stop", None)


def test_an_error_event_after_the_200_raises():
    stream = UpstreamStream("http://u/v1")
    with pytest.raises(UpstreamError) as err:
        stream.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"engine died"}}\n\n')
    assert err.value.message == "upstream http://u/v1 failed mid-stream: engine died"


def test_the_events_of_a_read_decode_together_and_a_bad_one_fails_as_it_would_alone():
    good = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert UpstreamStream("http://u/v1").feed(good * 3).text == "aaa"
    with pytest.raises(json.JSONDecodeError) as bad:
        UpstreamStream("http://u/v1").feed(good + b"data: {nope\n\n" + good)
    assert bad.value.doc == "{nope"  # the bad event, parsed alone
    # Two events that happen to parse as one array of another length: each parsed alone.
    with pytest.raises(json.JSONDecodeError):
        UpstreamStream("http://u/v1").feed(b'data: {"choices":[]},{"choices":[]}\n\ndata: {"choices":[]}\n\n')


def test_forwarding_reuses_one_connection_and_sends_a_burst_as_one_delta():
    async def run() -> tuple[list[list], int, int]:
        upstream = await InstantUpstream.start()
        engine = OpenAIEngine(
            EngineConfig(backend="openai", model="ragspeed-demo"), UpstreamConfig(urls=(upstream.url,))
        )
        await engine.start()
        try:
            runs = []
            for i in range(3):
                request = GenerationRequest(f"r{i}", (1, 2, 3), SamplingParams(max_tokens=16), prompt="hi")
                runs.append([delta async for delta in engine.generate(request)])
        finally:
            await engine.shutdown()
            await upstream.close()
        return runs, upstream.num_connections, upstream.num_requests

    runs, num_connections, num_requests = asyncio.run(run())
    # The body is read to its end, so its connection goes back to the pool.
    assert (num_connections, num_requests) == (1, 3)
    for deltas in runs:
        # The upstream wrote all 16 tokens and `[DONE]` at once: one read, so one delta, the
        # last, with the text, the finish reason and the usage.
        assert [(d.text, d.finish_reason, d.num_completion_tokens, d.num_prompt_tokens) for d in deltas] == [
            (" tok" * 16, "length", 16, PROMPT_TOKENS)
        ]


def test_an_upstream_rejection_keeps_its_status_and_a_body_without_done_still_ends():
    async def scenario() -> tuple[EngineError, list]:
        answers = [
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 33\r\n\r\n"
            b'{"error":{"message":"bad top_p"}}',
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 34\r\n\r\n"
            b'data: {"choices":[{"text":"Hi"}]}\n',
        ]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
                writer.write(answers.pop(0))
            await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        engine = OpenAIEngine(
            EngineConfig(backend="openai", model="ragspeed-demo"), UpstreamConfig(urls=(url,))
        )
        await engine.start()
        request = GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), prompt="hi")
        try:
            with pytest.raises(EngineError) as rejected:
                [d async for d in engine.generate(request)]
            deltas = [d async for d in engine.generate(request)]
        finally:
            await engine.shutdown()
            server.close()
        return rejected.value, deltas

    rejected, deltas = asyncio.run(scenario())
    assert (rejected.status_code, rejected.code) == (400, "upstream_rejected")
    assert rejected.message.endswith("answered 400: bad top_p")
    assert [(d.text, d.finish_reason) for d in deltas] == [("Hi", None), ("", "stop")]


# Chat mode: the gateway's chat body goes to /v1/chat/completions; deltas come back as sent.

CALL_START = {
    "index": 0,
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": ""},
}
CALL_ARGS = {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
LOGPROBS_A = {"content": [{"token": "It", "logprob": -0.5, "bytes": [73, 116], "top_logprobs": []}]}
LOGPROBS_B = {"content": [{"token": "'s", "logprob": -0.25, "bytes": [39, 115], "top_logprobs": []}]}


def _chunk(choice: dict | None = None, usage: dict | None = None) -> bytes:
    event = {"object": "chat.completion.chunk", "choices": [choice] if choice else []}
    if usage:
        event["usage"] = usage
    return b"data: " + json.dumps(event).encode() + b"\n\n"


CHAT_STREAM = (
    _chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})
    + _chunk({"index": 0, "delta": {"content": "It"}, "logprobs": LOGPROBS_A})
    + _chunk({"index": 0, "delta": {"content": "'s"}, "logprobs": LOGPROBS_B})
    + _chunk({"index": 0, "delta": {"tool_calls": [CALL_START]}})
    + _chunk({"index": 0, "delta": {"tool_calls": [CALL_ARGS]}})
    + _chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    + _chunk(usage={"prompt_tokens": 12, "completion_tokens": 9, "prompt_tokens_details": None})
    + b"data: [DONE]\n\n"
)


def test_a_chat_stream_gives_content_tool_call_deltas_and_logprobs_as_they_came():
    stream = UpstreamStream("http://u/v1", chat=True)
    piece = stream.feed(CHAT_STREAM)
    assert stream.done and piece.text == "It's"
    assert piece.tool_calls == (CALL_START, CALL_ARGS)  # the gateway merges them by index
    # Two events' logprobs in one read: their token lists joined, in order.
    assert piece.wire_logprobs == {"content": LOGPROBS_A["content"] + LOGPROBS_B["content"]}
    final = stream.final_delta(piece)
    assert (final.text, final.tool_calls, final.finish_reason) == ("It's", piece.tool_calls, "tool_calls")
    assert (final.num_prompt_tokens, final.num_cached_tokens, final.num_completion_tokens) == (12, 0, 9)


@pytest.mark.parametrize("cut", [10, 200, 330, 500])
def test_a_chat_stream_split_across_reads_loses_nothing(cut):
    stream = UpstreamStream("http://u/v1", chat=True)
    pieces = [stream.feed(CHAT_STREAM[:cut]), stream.feed(CHAT_STREAM[cut:])]
    assert "".join(p.text for p in pieces) == "It's"
    assert tuple(c for p in pieces for c in p.tool_calls) == (CALL_START, CALL_ARGS)
    tokens = [t["token"] for p in pieces if p.wire_logprobs for t in p.wire_logprobs["content"]]
    assert tokens == ["It", "'s"]


def test_the_chat_body_names_the_upstream_model_and_always_streams_with_usage():
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [], "stream_options": {"x": 1}}
    request = GenerationRequest("r", (1,), prompt="hi", chat=chat, cache_salt="tenant-a")
    assert chat_body("up", request) == {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [],
        "model": "up",
        "stream": True,
        "stream_options": {"x": 1, "include_usage": True},
        "cache_salt": "tenant-a",  # the gateway's salt: a tenant's wins over the client's
    }
    assert chat == {"messages": [{"role": "user", "content": "hi"}], "tools": [], "stream_options": {"x": 1}}


class ChatServer:
    """A real HTTP/1.1 server that records every request (path, JSON body) and answers each with
    `stream`, written in two parts, so that the client reads it in (at least) two pieces."""

    def __init__(self, stream: bytes = CHAT_STREAM):
        self.stream = stream
        self.requests: list[tuple[str, dict]] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(length))
            self.requests.append((head.split(b" ")[1].decode(), body))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            half = self.stream.index(b"data:", len(self.stream) // 2)
            for part in (self.stream[:half], self.stream[half:]):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


def _chat_engine(*urls: str, api: str = "chat") -> OpenAIEngine:
    return OpenAIEngine(
        EngineConfig(backend="openai", model="ragspeed-demo"),
        UpstreamConfig(urls=urls, model="up", api=api, max_retries=1),
    )


def test_chat_mode_posts_the_chat_body_and_streams_back_what_came():
    chat = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        "tool_choice": "auto",
        "logprobs": True,
        "vendor_knob": {"a": 1},
    }

    async def run() -> tuple[list, list, bool, dict]:
        server = ChatServer()
        url = await server.start()
        # The first upstream refuses connections: the request is retried on the second.
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        engine = _chat_engine(dead, url)
        await engine.start()
        try:
            # Logprobs asked for: refused on /v1/completions, passed back in chat mode.
            request = GenerationRequest(
                "r", (1, 2), SamplingParams(max_tokens=8, logprobs=0), prompt="p", chat=chat
            )
            deltas = [d async for d in engine.generate(request)]
        finally:
            await engine.shutdown()
            server.close()
        return deltas, server.requests, engine.forwards_chat, engine.stats()

    deltas, requests, forwards_chat, stats = asyncio.run(run())
    assert forwards_chat
    assert requests == [
        (
            "/v1/chat/completions",
            {**chat, "model": "up", "stream": True, "stream_options": {"include_usage": True}},
        )
    ]
    assert (stats["upstream_retries_total"], stats["upstream_errors_total"]) == (1.0, 1.0)
    assert len(deltas) == 2  # one delta a read; the finish reason and usage on the last
    assert "".join(d.text for d in deltas) == "It's"
    assert tuple(c for d in deltas for c in d.tool_calls) == (CALL_START, CALL_ARGS)
    assert [t["token"] for d in deltas if d.wire_logprobs for t in d.wire_logprobs["content"]] == ["It", "'s"]
    assert (deltas[-1].finish_reason, deltas[-1].num_completion_tokens) == ("tool_calls", 9)


def test_completions_mode_posts_the_rendered_prompt_and_refuses_logprobs():
    async def run() -> tuple[list, bool, EngineError]:
        upstream = await InstantUpstream.start()
        engine = _chat_engine(upstream.url, api="completions")
        await engine.start()
        try:
            # A request without a chat body goes to /v1/completions in either mode.
            request = GenerationRequest("r", (1,), SamplingParams(max_tokens=2), prompt="hi")
            deltas = [d async for d in engine.generate(request)]
            with pytest.raises(EngineError) as refused:
                request = GenerationRequest("r", (1,), SamplingParams(max_tokens=2, logprobs=0), prompt="hi")
                [d async for d in engine.generate(request)]
        finally:
            await engine.shutdown()
            await upstream.close()
        return deltas, engine.forwards_chat, refused.value

    deltas, forwards_chat, refused = asyncio.run(run())
    assert not forwards_chat
    assert [(d.text, d.finish_reason) for d in deltas] == [(" tok tok", "length")]
    assert (refused.param, refused.code) == ("logprobs", "logprobs_unsupported")


def test_an_unknown_upstream_api_fails_at_construction():
    with pytest.raises(ValueError, match="upstream api must be one of chat, completions, got 'rest'"):
        _chat_engine("http://127.0.0.1:1", api="rest")
