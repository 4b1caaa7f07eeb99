"""ragspeed's Python SDK: sync and async clients over httpx, with typed results.

    from ragspeed.gateway.client import RagspeedClient
    client = RagspeedClient("http://127.0.0.1:8000")
    result = client.chat("Who won?", documents=["...", {"title": "T", "text": "..."}],
                         system="Answer from the documents.", compression={"rate": 0.25})
    print(result.text, result.usage.cached_tokens, result.timings_ms)

Any OpenAI client works against ragspeed as well; this one adds the RAG fields and figures.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

# A document on the wire: its text, or {"text", "title"?, "id"?, "metadata"?}.
DocumentLike = str | dict[str, Any]


class RagspeedError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"{status_code}: {message}" + (f" (param {param})" if param else ""))
        self.status_code, self.message, self.param, self.code = status_code, message, param, code


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def from_wire(cls, usage: dict[str, Any] | None) -> Usage:
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
            details.get("cached_tokens") or 0,
        )


@dataclass(frozen=True)
class Compression:
    method: str
    original_tokens: int
    compressed_tokens: int
    ms: float
    failed: bool
    skipped_reason: str | None = None

    @property
    def ratio(self) -> float:
        return self.original_tokens / max(self.compressed_tokens, 1)


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str | None
    usage: Usage
    timings_ms: dict[str, float] = field(default_factory=dict)
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    arm: str | None = None
    compression: Compression | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_parts(
        cls, text: str, finish_reason: str | None, usage: dict | None, ragspeed: dict | None, raw: dict
    ) -> ChatResult:
        ragspeed = ragspeed or {}
        comp = ragspeed.get("compression")
        return cls(
            text=text,
            finish_reason=finish_reason,
            usage=Usage.from_wire(usage),
            timings_ms=ragspeed.get("timings_ms", {}),
            ttft_ms=ragspeed.get("ttft_ms"),
            e2e_ms=ragspeed.get("e2e_ms"),
            arm=ragspeed.get("arm"),
            compression=Compression(**comp) if comp else None,
            raw=raw,
        )


@dataclass(frozen=True)
class ChatChunk:
    """One streamed piece; the last one carries the finished `result`."""

    text: str
    result: ChatResult | None = None


def build_chat_body(
    question: str | None,
    *,
    messages: Sequence[dict] | None,
    documents: Sequence[DocumentLike] | None,
    system: str | None,
    model: str | None,
    stream: bool,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    compression: dict | bool | None,
    system_prompt: str | None,
    retrieval: dict | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    if messages is None:
        if question is None:
            raise ValueError("give a question or messages")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}
        ]
    body: dict[str, Any] = {"messages": list(messages), "stream": stream, **extra}
    if model is not None:
        body["model"] = model
    if documents:
        body["documents"] = [d if isinstance(d, str) else dict(d) for d in documents]
    for key, value in (("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed)):
        if value is not None:
            body[key] = value
    options = {
        k: v
        for k, v in (("compression", compression), ("system_prompt", system_prompt), ("retrieval", retrieval))
        if v is not None
    }
    if options:
        body["ragspeed"] = options
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _raise_for_error(response: httpx.Response, body: bytes) -> None:
    if response.status_code < 400:
        return
    try:
        error = json.loads(body)["error"]
        raise RagspeedError(response.status_code, error["message"], error.get("param"), error.get("code"))
    except (ValueError, KeyError, TypeError):
        raise RagspeedError(response.status_code, body.decode("utf-8", "replace")) from None


class _StreamAssembler:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.ragspeed: dict | None = None
        self.usage: dict | None = None

    def feed(self, line: str) -> str | None:
        """Take one SSE line; return new text, or None."""
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return None
        chunk = json.loads(data)
        if "error" in chunk:
            raise RagspeedError(500, chunk["error"].get("message", "stream failed"))
        self.usage = chunk.get("usage") or self.usage
        self.ragspeed = chunk.get("ragspeed") or self.ragspeed
        text = ""
        for choice in chunk.get("choices", []):
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            text += (choice.get("delta") or {}).get("content") or ""
        self.parts.append(text)
        return text

    def result(self) -> ChatResult:
        return ChatResult.from_parts("".join(self.parts), self.finish_reason, self.usage, self.ragspeed, {})


class RagspeedClient:
    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout: float = 300.0
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RagspeedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, question: str | None = None, **kwargs: Any) -> ChatResult:
        """One chat request. Keywords: messages, documents, system, model, max_tokens,
        temperature, seed, compression, system_prompt, retrieval; any other is a body field."""
        body = build_chat_body(question, stream=False, **_body_kwargs(kwargs))
        response = self._http.post("/v1/chat/completions", json=body)
        _raise_for_error(response, response.content)
        data = response.json()
        choice = data["choices"][0]
        return ChatResult.from_parts(
            choice["message"]["content"],
            choice["finish_reason"],
            data.get("usage"),
            data.get("ragspeed"),
            data,
        )

    def chat_stream(self, question: str | None = None, **kwargs: Any) -> Iterator[ChatChunk]:
        body = build_chat_body(question, stream=True, **_body_kwargs(kwargs))
        with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code >= 400:
                _raise_for_error(response, response.read())
            assembler = _StreamAssembler()
            for line in response.iter_lines():
                text = assembler.feed(line)
                if text:
                    yield ChatChunk(text)
            yield ChatChunk("", assembler.result())

    def models(self) -> list[str]:
        response = self._http.get("/v1/models")
        _raise_for_error(response, response.content)
        return [m["id"] for m in response.json()["data"]]


class AsyncRagspeedClient:
    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None, timeout: float = 300.0
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRagspeedClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def chat(self, question: str | None = None, **kwargs: Any) -> ChatResult:
        body = build_chat_body(question, stream=False, **_body_kwargs(kwargs))
        response = await self._http.post("/v1/chat/completions", json=body)
        _raise_for_error(response, response.content)
        data = response.json()
        choice = data["choices"][0]
        return ChatResult.from_parts(
            choice["message"]["content"],
            choice["finish_reason"],
            data.get("usage"),
            data.get("ragspeed"),
            data,
        )

    async def chat_stream(self, question: str | None = None, **kwargs: Any) -> AsyncIterator[ChatChunk]:
        body = build_chat_body(question, stream=True, **_body_kwargs(kwargs))
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code >= 400:
                _raise_for_error(response, await response.aread())
            assembler = _StreamAssembler()
            async for line in response.aiter_lines():
                text = assembler.feed(line)
                if text:
                    yield ChatChunk(text)
            yield ChatChunk("", assembler.result())


_BODY_KEYS = (
    "messages",
    "documents",
    "system",
    "model",
    "max_tokens",
    "temperature",
    "seed",
    "compression",
    "system_prompt",
    "retrieval",
)


def _body_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Split keyword arguments into build_chat_body's named ones and extra body fields."""
    named = {key: kwargs.pop(key, None) for key in _BODY_KEYS}
    return {**named, "extra": kwargs}
