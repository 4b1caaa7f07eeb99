"""The openai backend's forwarding path: the SSE reader, and a real round trip to the instant
upstream (one pooled connection, bursts as one delta, usage on the last)."""

from __future__ import annotations

import asyncio

import pytest

from ragspeed.bench.instant_upstream import PROMPT_TOKENS, InstantUpstream
from ragspeed.engine.backends.openai_backend import OpenAIEngine, UpstreamStream
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import GenerationRequest, SamplingParams, UpstreamError

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
        assert "".join(d.text for d in deltas) == " tok" * 16
        # The upstream wrote all 16 tokens at once: fewer deltas than tokens (one per read).
        assert len([d for d in deltas if d.text]) < 16
        final = deltas[-1]
        assert (final.finish_reason, final.num_completion_tokens, final.num_prompt_tokens) == (
            "length",
            16,
            PROMPT_TOKENS,
        )
