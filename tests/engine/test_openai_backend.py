"""The openai backend's forwarding path: the SSE reader, and a real round trip to the instant
upstream (one pooled connection, bursts as one delta, usage on the last)."""

from __future__ import annotations

import asyncio
import json

import pytest

from ragspeed.bench.instant_upstream import PROMPT_TOKENS, InstantUpstream
from ragspeed.engine.backends.openai_backend import OpenAIEngine, UpstreamStream
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
    assert stream.feed(STREAM) == "Hello"
    final = stream.final_delta()
    assert (final.text, final.finish_reason) == ("", "length")
    assert (final.num_prompt_tokens, final.num_cached_tokens, final.num_completion_tokens) == (5, 3, 2)


@pytest.mark.parametrize("cut", [1, 7, 40, 70, 71, 150])
def test_events_split_across_reads_come_out_whole(cut):
    stream = UpstreamStream("http://u/v1")
    texts = [stream.feed(STREAM[:cut]), stream.feed(STREAM[cut:]), stream.feed(b"\n")]
    assert "".join(texts) == "Hello"
    assert stream.final_delta().num_completion_tokens == 2


def test_a_stream_without_usage_or_finish_ends_as_stop():
    stream = UpstreamStream("http://u/v1")
    assert stream.feed(b'data: {"choices":[{"text":"x"}]}') == ""  # no newline yet: held
    assert stream.feed(b"\n") == "x"
    final = stream.final_delta()
    assert (final.finish_reason, final.num_completion_tokens) == ("stop", None)


def test_an_error_event_after_the_200_raises():
    stream = UpstreamStream("http://u/v1")
    with pytest.raises(UpstreamError) as err:
        stream.feed(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"error":{"message":"engine died"}}\n\n')
    assert err.value.message == "upstream http://u/v1 failed mid-stream: engine died"


def test_the_events_of_a_read_decode_together_and_a_bad_one_fails_as_it_would_alone():
    good = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert UpstreamStream("http://u/v1").feed(good * 3) == "aaa"
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
