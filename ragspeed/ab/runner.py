"""Replay a workload against one real server per arm, interleaving arms in time.

Schedule: the workload is cut into *blocks* of `block_size` items; every block is served by each
arm in turn, the order of arms rotating from block to block (AB, BA, ...), so slow drift of the
machine (other jobs, thermal state) falls on all arms alike. Only one arm runs at a time, so arms
never compete for the CPU.

- closed loop (`concurrency=C`): C clients, each sending its next request when the last returned;
- open loop (`rate=R`): requests leave at Poisson arrival times of rate R per second, whether or
  not earlier ones returned; every arm gets the same arrival times for the same block.

TTFT is measured by the client: from sending the request to the first streamed chunk (the
gateway primes its streams, so its first chunk leaves only once the engine made the first token;
text may lag behind tokens while the detokenizer waits for whole characters).
TPOT is `(e2e - ttft) / (completion_tokens - 1)`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from ragspeed.ab.arms import Arm
from ragspeed.ab.quality import accuracy, contains_answer, exact_match, f1
from ragspeed.ab.workload import WorkItem
from ragspeed.bench.launcher import ServerProcess


@dataclass(frozen=True)
class LoadShape:
    """Closed loop at `concurrency`, or open loop at `rate` requests/s when `rate` is set."""

    concurrency: int = 1
    rate: float | None = None
    block_size: int = 8
    warmup: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.warmup < 0:
            raise ValueError("warmup must be 0 or more")

    @property
    def mode(self) -> str:
        return "open" if self.rate is not None else "closed"


@dataclass(frozen=True)
class Observation:
    """One request of one arm, as the client saw it plus the server's `ragspeed` figures."""

    arm: str
    line: int  # the workload line
    ok: bool
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    document_tokens: int | None = None  # before compression, when the gateway compressed
    compressed_tokens: int | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    text: str = ""
    exact_match: float | None = None
    f1: float | None = None
    accuracy: float | None = None
    answer_in_documents: bool = False
    answer_in_prompt: bool | None = None  # None: the server did not return the prompt


@dataclass(frozen=True)
class RunResult:
    observations: tuple[Observation, ...]
    busy_seconds: dict[str, float]  # wall time each arm spent serving its blocks
    wall_seconds: float


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in `overlay` replaces."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def request_body(item: WorkItem, arm: Arm) -> dict[str, Any]:
    body = merge(item.body, dict(arm.request))
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if item.answers:
        ragspeed = body.get("ragspeed") or {}
        body["ragspeed"] = {**ragspeed, "return_prompt": True}
    return body


@dataclass(frozen=True)
class _Streamed:
    """One streamed reply: its seconds (perf_counter) at the request, the first chunk with
    content or role (None: none came) and the end; its text pieces, usage and ragspeed field."""

    start: float
    first_at: float | None
    end: float
    parts: list[str]
    usage: dict[str, Any]
    ragspeed: dict[str, Any]


async def send(http: httpx.AsyncClient, url: str, arm: Arm, item: WorkItem) -> Observation:
    """One request of the workload to an arm's server: its latencies and its answer's scores."""
    body = request_body(item, arm)
    try:
        streamed = await _stream(http, url, body)
    except httpx.HTTPError as exc:
        return Observation(arm.name, item.line, ok=False, error=f"{type(exc).__name__}: {exc}")
    if isinstance(streamed, str):
        return Observation(arm.name, item.line, ok=False, error=streamed)
    return _observe(arm, item, body, streamed)


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> _Streamed | str:
    """Stream the chat completion of `body`; the reply, or `status: message` of an error."""
    t0 = time.perf_counter()
    first_at: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    ragspeed: dict[str, Any] = {}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            try:
                message = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = text[:300]
            return f"{response.status_code}: {message}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if first_at is None and (delta.get("content") or delta.get("role")):
                    first_at = time.perf_counter()
                if delta.get("content"):
                    parts.append(delta["content"])
            usage = chunk.get("usage") or usage
            ragspeed = chunk.get("ragspeed") or ragspeed
    end = time.perf_counter()  # the response closed, as a client sees its end
    return _Streamed(t0, first_at, end, parts, usage, ragspeed)


def _observe(arm: Arm, item: WorkItem, body: dict[str, Any], streamed: _Streamed) -> Observation:
    """The observation of a streamed reply: latencies, token counts and the answer's scores."""
    usage, ragspeed = streamed.usage, streamed.ragspeed
    e2e_ms = (streamed.end - streamed.start) * 1000
    ttft_ms = ((streamed.first_at or streamed.end) - streamed.start) * 1000
    completion_tokens = int(usage.get("completion_tokens") or 0)
    tpot_ms = (e2e_ms - ttft_ms) / (completion_tokens - 1) if completion_tokens > 1 else None
    text = "".join(streamed.parts)
    compression = ragspeed.get("compression") or {}
    prompt = ragspeed.get("prompt")
    if prompt is not None:
        # Only the documents count: a static system prompt may quote example answers.
        for message in body.get("messages", []):
            if message.get("role") in ("system", "developer") and isinstance(message.get("content"), str):
                prompt = prompt.replace(message["content"], "")
    in_docs = bool(item.answers) and contains_answer(item.document_text, item.answers)
    return Observation(
        arm=arm.name,
        line=item.line,
        ok=True,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        tpot_ms=tpot_ms,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        completion_tokens=completion_tokens,
        document_tokens=compression.get("original_tokens"),
        compressed_tokens=compression.get("compressed_tokens"),
        timings_ms=dict(ragspeed.get("timings_ms") or {}),
        text=text,
        exact_match=exact_match(text, item.answers) if item.answers else None,
        f1=f1(text, item.answers) if item.answers else None,
        accuracy=accuracy(text, item.answers) if item.answers else None,
        answer_in_documents=in_docs,
        answer_in_prompt=contains_answer(prompt, item.answers) if (in_docs and prompt is not None) else None,
    )


def blocks(items: tuple[WorkItem, ...], size: int) -> list[tuple[WorkItem, ...]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def arm_order(num_arms: int, block_index: int) -> list[int]:
    """Rotate the arms block by block: 0 1 2, 1 2 0, 2 0 1, ..."""
    return [(block_index + k) % num_arms for k in range(num_arms)]


async def _closed(block: tuple[WorkItem, ...], concurrency: int, run_one) -> list[Observation]:
    queue = list(enumerate(block))
    results: list[Observation | None] = [None] * len(block)

    async def client() -> None:
        while queue:
            index, item = queue.pop(0)
            results[index] = await run_one(item)

    await asyncio.gather(*(client() for _ in range(min(concurrency, len(block)))))
    return [r for r in results if r is not None]


async def _open(block: tuple[WorkItem, ...], offsets: list[float], run_one) -> list[Observation]:
    start = time.perf_counter()

    async def at(offset: float, item: WorkItem) -> Observation:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await run_one(item)

    return list(await asyncio.gather(*(at(o, it) for o, it in zip(offsets, block))))


async def replay(
    arms: list[Arm],
    urls: dict[str, str],
    items: tuple[WorkItem, ...],
    shape: LoadShape,
    on_done: Callable[[Observation], None] = lambda obs: None,
    timeout_s: float = 600.0,
) -> RunResult:
    """Warm every arm up, then serve the blocks arm by arm in rotating order."""
    rng = random.Random(shape.seed)
    observations: list[Observation] = []
    busy = {arm.name: 0.0 for arm in arms}
    limits = httpx.Limits(max_connections=max(shape.concurrency, 64))
    t_start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as http:
        for arm in arms:
            for item in items[: shape.warmup]:
                await send(http, urls[arm.name], arm, item)
        for index, block in enumerate(blocks(items, shape.block_size)):
            # The same Poisson arrival times for every arm within a block: a paired comparison.
            offsets, t = [], 0.0
            for _ in block:
                offsets.append(t)
                t += rng.expovariate(shape.rate) if shape.rate else 0.0
            for a in arm_order(len(arms), index):
                arm = arms[a]

                async def run_one(item: WorkItem, arm: Arm = arm) -> Observation:
                    obs = await send(http, urls[arm.name], arm, item)
                    on_done(obs)
                    return obs

                t0 = time.perf_counter()
                if shape.rate is None:
                    observations.extend(await _closed(block, shape.concurrency, run_one))
                else:
                    observations.extend(await _open(block, offsets, run_one))
                busy[arm.name] += time.perf_counter() - t0
    return RunResult(tuple(observations), busy, time.perf_counter() - t_start)


@contextmanager
def arm_servers(arms: list[Arm], *, ready_timeout_s: float = 600.0) -> Iterator[dict[str, str]]:
    """Start one `ragspeed serve --config ARM.yaml` per arm (in parallel); yield {arm: url}."""
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="ragspeed-ab-") as tmp:
        servers: dict[str, ServerProcess] = {}
        for arm in arms:
            config = Path(tmp) / f"{arm.name}.yaml"
            config.write_text(yaml.safe_dump(dict(arm.settings), sort_keys=True), encoding="utf-8")
            servers[arm.name] = ServerProcess(["--config", str(config)], ready_timeout_s=ready_timeout_s)
        for server in servers.values():
            stack.callback(server.stop)
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            futures = {name: pool.submit(server.start) for name, server in servers.items()}
            errors = []
            for name, future in futures.items():
                try:
                    future.result()
                except Exception as exc:  # report every arm that failed, not just the first
                    errors.append(f"arm '{name}': {exc}")
        if errors:
            raise RuntimeError("could not start the arms' servers:\n" + "\n".join(errors))
        yield {name: server.url for name, server in servers.items()}
