"""The openai backend: forwards requests to OpenAI-compatible upstream servers.

Upstreams are vLLM, SGLang, TGI, llama.cpp's server or another ragspeed. Two modes
(`UpstreamConfig.api`):

- *chat* (the default): a chat request goes to the upstream's `/v1/chat/completions` as a chat
  request (`GenerationRequest.chat`, built by the gateway: the client's messages and fields,
  the compressed documents in the system message), so that tools, response formats, logprobs
  and vendor fields work as they do against the upstream itself. Tool-call deltas and logprobs
  come back as the upstream sent them.
- *completions*: the prompt the gateway rendered through ragspeed's own chat template goes to
  `/v1/completions` as text (so does every text-completion request, in either mode).

Either way the answer streams back. Closing the stream (the client went away) closes the
upstream connection, which makes the upstream abort too. The requests go through a small
pooled HTTP/1.1 client of the backend's own (engine/backends/remote/http11.py): one write a request;
in `ragspeed bench gateway` it serves 4x httpx's requests a second and 1.3x aiohttp's
(docs/benchmarks.md, "Proxy HTTP client").

Failures: a request that failed to connect (nothing was sent, so it is safe to repeat) is
retried on the next upstream after a jittered backoff, up to `upstream_max_retries` times.
Each upstream has a circuit breaker: `upstream_circuit_failures` failures in a row (connect
errors, timeouts, 5xx) open it, and requests skip that upstream until, `upstream_circuit_reset_s`
later, one trial request is let through (half-open): success closes it, failure reopens it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from ragspeed.engine.backends.remote import http11
from ragspeed.engine.backends.remote.routing import AffinityRouter
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.native.loading.model_zoo import resolve_model
from ragspeed.engine.protocol import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
    UpstreamError,
    UpstreamTimeoutError,
)

_UNKNOWN_CONTEXT = 1 << 20  # the upstream enforces its own limit
_BACKOFF_BASE_S = 0.05  # retry k sleeps uniform(0, base * 2**k), capped: "full jitter"
_BACKOFF_CAP_S = 2.0
UPSTREAM_APIS = ("chat", "completions")  # UpstreamConfig.api: the modes of the module docstring


class CircuitBreaker:
    """closed → open after `failure_threshold` failures in a row → half-open after `reset_s`
    (one trial request at a time) → closed on a success, open again on a failure."""

    def __init__(self, failure_threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic):
        self.failure_threshold, self.reset_s, self._clock = failure_threshold, reset_s, clock
        self.state = "closed"
        self.num_failures = 0
        self._changed_at = 0.0  # when it opened, or when the current trial began

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        now = self._clock()
        if now - self._changed_at < self.reset_s:
            return False  # open and cooling down, or a trial is in flight
        # The wait is over (or a trial never reported back, e.g. its client left): one trial.
        self.state, self._changed_at = "half_open", now
        return True

    def record_success(self) -> None:
        self.state, self.num_failures = "closed", 0

    def record_failure(self) -> None:
        self.num_failures += 1
        if self.state == "half_open" or self.num_failures >= self.failure_threshold:
            self.state, self._changed_at = "open", self._clock()


def upstream_base_url(url: str) -> str:
    """`http://host:8000`, `http://host:8000/` and `http://host:8000/v1` all mean the same."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def completion_body(model: str, request: GenerationRequest) -> dict[str, Any]:
    sampling: SamplingParams = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        # The gateway rendered the prompt through the chat template, BOS included.
        "add_special_tokens": False,
    }
    # vLLM-style extensions, sent only when they differ from the defaults.
    if sampling.top_k:
        body["top_k"] = sampling.top_k
    if sampling.min_p:
        body["min_p"] = sampling.min_p
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    return body


def chat_body(model: str, request: GenerationRequest) -> dict[str, Any]:
    """The gateway's chat body (`request.chat`) with what the backend decides: the upstream's
    model name, a stream with the usage at its end, and the tenant's cache salt."""
    assert request.chat is not None
    body = dict(request.chat)
    body["model"] = model
    body["stream"] = True
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    return body


class UpstreamStream:
    """One upstream stream (SSE of `text_completion` chunks, or of `chat.completion.chunk`s
    with `chat`), read as it arrives: `feed(bytes)` returns a delta of what the events those
    bytes completed hold (a read may end mid-line: the rest waits for the next), and
    `final_delta()` the finish reason and usage."""

    def __init__(self, base_url: str, chat: bool = False) -> None:
        self.base_url = base_url
        self.chat = chat
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False  # `data: [DONE]` came; what follows is ignored
        self._tail = b""

    def feed(self, data: bytes) -> TokenDelta:
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()
        payloads: list[bytes] = []
        for line in lines:
            if self.done or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            payloads.append(payload)
        parts: list[str] = []
        tool_calls: list[dict[str, Any]] = []
        logprobs: list[dict[str, Any]] = []
        for payload, chunk in zip(payloads, _decode(payloads)):
            if "error" in chunk:  # a server that fails after its 200 says so in-stream
                raise UpstreamError(
                    f"upstream {self.base_url} failed mid-stream: {_error_message(payload)}",
                    code="upstream_error",
                )
            # With include_usage the last chunk has the counts and no choices.
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk.get("choices") or ():
                # The finish reason is held back for the usage chunk that follows it.
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
                if not self.chat:
                    if choice.get("text"):
                        parts.append(choice["text"])
                    continue
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    parts.append(delta["content"])
                tool_calls += delta.get("tool_calls") or ()
                if choice.get("logprobs"):
                    logprobs.append(choice["logprobs"])
        return TokenDelta(
            text="".join(parts), tool_calls=tuple(tool_calls), wire_logprobs=_merge_logprobs(logprobs)
        )

    def final_delta(self, last: TokenDelta | None = None) -> TokenDelta:
        """The last delta: what the last read brought (`last`), the finish reason, the usage."""
        last = last or TokenDelta(text="")
        if self.usage is None:
            return dataclasses.replace(last, finish_reason=self.finish_reason or "stop")
        details = self.usage.get("prompt_tokens_details") or {}
        return dataclasses.replace(
            last,
            finish_reason=self.finish_reason or "stop",
            num_prompt_tokens=self.usage.get("prompt_tokens", 0),
            num_cached_tokens=details.get("cached_tokens") or 0,
            num_completion_tokens=self.usage.get("completion_tokens", 0),
        )


def _merge_logprobs(logprobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `choices[0].logprobs` of the events of one read as one: their per-token lists
    (`content`, `refusal`) joined in order."""
    if len(logprobs) <= 1:
        return logprobs[0] if logprobs else None
    merged: dict[str, Any] = {}
    for entry in logprobs:
        for key, value in entry.items():
            if isinstance(value, list) and isinstance(merged.get(key), list):
                merged[key] = merged[key] + value
            elif value is not None or key not in merged:
                merged[key] = value
    return merged


def _decode(payloads: list[bytes]) -> list[Any]:
    """The JSON of every payload: one parse of them all as an array (a read of many events
    costs one call, not one each), else, when that fails or does not give one value a
    payload, each on its own, so that a bad one fails as it would alone."""
    if len(payloads) > 1:
        try:
            values = json.loads(b"[" + b",".join(payloads) + b"]")
        except ValueError:
            values = None
        if isinstance(values, list) and len(values) == len(payloads):
            return values
    return [json.loads(payload) for payload in payloads]


def _error_message(response_body: bytes) -> str:
    try:
        error = json.loads(response_body)["error"]
        return error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return response_body.decode("utf-8", "replace")[:500]


class OpenAIEngine:
    def __init__(self, config: EngineConfig, upstream: UpstreamConfig):
        if not upstream.urls:
            raise ValueError("the openai engine needs at least one upstream URL (--upstream)")
        self.config = config
        self.upstream = upstream
        self.model_name = config.model
        self.upstream_model = upstream.model or config.model
        self.max_model_len = config.max_model_len or _UNKNOWN_CONTEXT
        if upstream.api not in UPSTREAM_APIS:
            raise ValueError(f"upstream api must be one of {', '.join(UPSTREAM_APIS)}, got {upstream.api!r}")
        # The gateway builds GenerationRequest.chat only for a backend that forwards chat.
        self.forwards_chat = upstream.api == "chat"
        self._base_urls = [upstream_base_url(u) for u in upstream.urls]
        self._next_upstream = itertools.cycle(range(len(self._base_urls)))
        self._pool: http11.ConnectionPool | None = None
        self._tokenizer: Any = None
        self._breakers = {
            url: CircuitBreaker(upstream.circuit_failures, upstream.circuit_reset_s)
            for url in self._base_urls
        }
        self._jitter = random.Random()
        # Same static prefix -> same upstream, so its prefix cache hits (engine/backends/remote/routing.py).
        self._router = (
            AffinityRouter(self._base_urls, block_size=config.block_size)
            if upstream.affinity and len(self._base_urls) > 1
            else None
        )
        self._counters = {"requests_total": 0.0, "upstream_errors_total": 0.0, "upstream_retries_total": 0.0}

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self) -> None:
        source = resolve_model(self.config.tokenizer or self.config.model, tokenizer_only=True)
        self._tokenizer = AutoTokenizer.from_pretrained(source)
        if not self.config.max_model_len and Path(source, "config.json").is_file():
            model_config = AutoConfig.from_pretrained(source)
            self.max_model_len = getattr(model_config, "max_position_embeddings", _UNKNOWN_CONTEXT)
        headers = {"accept": "*/*", "user-agent": "ragspeed"}
        if self.upstream.api_key:
            headers["authorization"] = f"Bearer {self.upstream.api_key}"
        self._pool = http11.ConnectionPool(
            connect_timeout_s=self.upstream.connect_timeout_s,
            read_timeout_s=self.upstream.read_timeout_s,
            headers=headers,
        )

    async def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.close()

    async def abort(self, request_id: str) -> None:
        """Aborting is closing the stream: the consumer of `generate()` does it."""

    async def warm(self, prefix_token_ids: tuple[int, ...], cache_salt: str | None = None) -> int:
        return 0

    async def store_documents(self, request: GenerationRequest) -> None:
        return None  # no document store

    def stats(self) -> dict[str, float]:
        open_circuits = sum(b.state != "closed" for b in self._breakers.values())
        return {**self._counters, "upstream_circuits_open": float(open_circuits)}

    def prefix_cache(self) -> None:
        return None  # each upstream's cache is its own; nothing here can pin in it

    def _pick_upstream(self, request: GenerationRequest, exclude: tuple[str, ...] = ()) -> str:
        """The static prefix's upstream (affinity on, skipping `exclude`: those this request
        already failed on), else the next upstream, round robin, whose circuit lets it through."""
        if self._router is not None:
            key = self._router.key(request.prompt_token_ids, request.num_static_tokens, request.cache_salt)
            if key is not None:
                routed = self._router.pick(key, lambda u: self._breakers[u].allow(), exclude)
                if routed is not None:
                    return routed
        for _ in range(len(self._base_urls)):
            base_url = self._base_urls[next(self._next_upstream)]
            if self._breakers[base_url].allow():
                return base_url
        error = UpstreamError(
            f"every upstream's circuit is open after repeated failures; retry in "
            f"{self.upstream.circuit_reset_s:g} s",
            code="upstream_unavailable",
        )
        error.status_code = 503
        raise error

    def _failed(self, base_url: str) -> None:
        self._counters["upstream_errors_total"] += 1
        self._breakers[base_url].record_failure()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        chat = request.chat is not None
        if request.sampling.logprobs is not None and not chat:
            # Upstream completions name tokens by their text, not their ids, so their logprobs
            # cannot become TokenLogprobs faithfully. A chat upstream's pass back as they came.
            raise EngineError(
                "the openai backend forwards logprobs only in chat mode (upstream_api: chat): "
                "upstream completions report tokens as text, not ids",
                param="logprobs",
                code="logprobs_unsupported",
            )
        assert self._pool is not None, "start() first"
        self._counters["requests_total"] += 1
        payload = (
            chat_body(self.upstream_model, request) if chat else completion_body(self.upstream_model, request)
        )
        # Compact, and UTF-8 as it is rather than \u escapes.
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        path = "/chat/completions" if chat else "/completions"
        tried: tuple[str, ...] = ()
        for attempt in range(self.upstream.max_retries + 1):
            base_url = self._pick_upstream(request, tried)
            tried += (base_url,)
            if self._router is not None:
                self._router.acquire(base_url)
            try:
                async with self._pool.post(base_url + path, body) as response:
                    if response.status_code != 200:
                        raise self._status_error(base_url, response.status_code, await response.aread())
                    self._breakers[base_url].record_success()
                    async for delta in self._parse_stream(response, UpstreamStream(base_url, chat)):
                        yield delta
                return
            except http11.ConnectError as exc:
                # Nothing reached the upstream, so repeating the request is safe.
                self._failed(base_url)
                if attempt < self.upstream.max_retries:
                    self._counters["upstream_retries_total"] += 1
                    cap = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt)
                    await asyncio.sleep(self._jitter.uniform(0, cap))
                    continue
                error_cls = UpstreamTimeoutError if isinstance(exc, http11.ConnectTimeout) else UpstreamError
                raise error_cls(
                    f"upstream {base_url} failed: {type(exc).__name__}: {exc} (after {attempt + 1} attempts)",
                    code="upstream_error",
                ) from exc
            except http11.Timeout as exc:
                self._failed(base_url)
                raise UpstreamTimeoutError(
                    f"upstream {base_url} timed out ({type(exc).__name__})", code="upstream_timeout"
                ) from exc
            except http11.HTTPError as exc:
                self._failed(base_url)
                raise UpstreamError(
                    f"upstream {base_url} failed: {type(exc).__name__}: {exc}", code="upstream_error"
                ) from exc
            finally:
                if self._router is not None:
                    self._router.release(base_url)

    def _status_error(self, base_url: str, status: int, body: bytes) -> EngineError:
        message = f"upstream {base_url} answered {status}: {_error_message(body)}"
        if 400 <= status < 500:
            self._breakers[base_url].record_success()  # the upstream is up; the request was bad
            error = EngineError(message, code="upstream_rejected")
            error.status_code = status
            return error
        self._failed(base_url)
        return UpstreamError(message, code="upstream_error")

    async def _parse_stream(
        self, response: http11.Response, stream: UpstreamStream
    ) -> AsyncIterator[TokenDelta]:
        """The upstream's SSE events as deltas: what every event that one network read
        completed holds goes out as one delta (a burst of tokens costs one delta, not one
        each), and the finish reason and usage go on the last delta, with what the read that
        brought `[DONE]` (or ended the body) held. After the last delta the body is read to its
        end, so that its connection goes back to the pool."""
        body = response.aiter_bytes()
        async for data in body:
            piece = stream.feed(data)
            if stream.done:
                yield stream.final_delta(piece)
                async for _ in body:
                    pass
                return
            if piece.text or piece.tool_calls or piece.wire_logprobs:
                yield piece
        # The body ended without `[DONE]`; its last line may lack its newline.
        yield stream.final_delta(stream.feed(b"\n"))
