"""The transformers backend: Hugging Face `generate()`, one request at a time.

It is the baseline arm of latency experiments: the plain way to serve a model with transformers,
with no batching, paging or prefix caching. `generate()` runs in a worker thread and streams
token ids back to the event loop through a queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute import cpu_features
from ragspeed.engine.native.core.detokenizer import IncrementalDetokenizer
from ragspeed.engine.native.core.stop import StopStringMatcher
from ragspeed.engine.native.loading.dtypes import model_dtype
from ragspeed.engine.native.loading.model_zoo import resolve_model, resolve_tokenizer
from ragspeed.engine.protocol import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
    check_context_length,
)

_DONE = object()


class _QueueStreamer(BaseStreamer):
    """Hands each new token id to the event loop; `generate()` first puts the prompt, skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self._loop, self._queue = loop, queue
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._loop.call_soon_threadsafe(self._queue.put_nowait, value.reshape(-1).tolist())

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, _DONE)


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self._event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        # transformers types the result as the legacy torch.BoolTensor, which no torch op returns
        return torch.full((input_ids.shape[0],), self._event.is_set(), dtype=torch.bool)  # type: ignore[return-value]


def generate_kwargs(sampling: SamplingParams, eos_token_ids: list[int]) -> dict[str, Any]:
    """Map ragspeed sampling parameters onto `generate()` keyword arguments."""
    kwargs: dict[str, Any] = {"max_new_tokens": sampling.max_tokens}
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or None,
            min_p=sampling.min_p or None,
        )
    stop_ids = [] if sampling.ignore_eos else list(eos_token_ids)
    stop_ids += [t for t in sampling.stop_token_ids if t not in stop_ids]
    kwargs["eos_token_id"] = stop_ids or None
    if sampling.ignore_eos:
        kwargs["min_new_tokens"] = sampling.max_tokens
    return kwargs


class TransformersEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.model
        self.max_model_len = config.max_model_len or 0
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos_token_ids: list[int] = []
        self._lock = asyncio.Lock()  # sequential generate(): this is the baseline
        self._cancel_events: dict[str, threading.Event] = {}
        self._num_requests = 0

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        path = resolve_model(self.config.model)
        # The whole model in one dtype; "auto": bf16 on a CPU that multiplies it at speed.
        dtype = model_dtype(self.config.dtype, self.config.device, cpu_features.read_cpu_features())
        self._tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer(self.config.tokenizer, path))
        self._model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self._model.to(self.config.device)
        model_len = getattr(self._model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        eos = self._model.generation_config.eos_token_id
        if eos is None:
            eos = self._tokenizer.eos_token_id
        self._eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])

    async def shutdown(self) -> None:
        for event in self._cancel_events.values():
            event.set()

    async def abort(self, request_id: str) -> None:
        event = self._cancel_events.get(request_id)
        if event is not None:
            event.set()

    async def warm(self, prefix_token_ids: tuple[int, ...], cache_salt: str | None = None) -> int:
        return 0  # no prefix cache in the baseline

    async def store_documents(self, request: GenerationRequest) -> None:
        return None  # no document store

    def stats(self) -> dict[str, float]:
        return {"requests_total": float(self._num_requests)}

    def prefix_cache(self) -> None:
        return None  # no prefix cache in the baseline

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if request.sampling.logprobs is not None:
            # generate() streams ids only; its scores come after the last token, processed.
            raise EngineError(
                "the transformers backend does not support logprobs; use the native engine",
                param="logprobs",
                code="logprobs_unsupported",
            )
        check_context_length(len(request.prompt_token_ids), request.sampling.max_tokens, self.max_model_len)
        cancel = threading.Event()
        self._cancel_events[request.request_id] = cancel
        try:
            async with self._lock:
                self._num_requests += 1
                async for delta in self._stream(request, cancel):
                    yield delta
        finally:
            cancel.set()  # also stops the worker thread when the consumer goes away
            self._cancel_events.pop(request.request_id, None)

    async def _stream(self, request: GenerationRequest, cancel: threading.Event):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sampling = request.sampling
        kwargs = generate_kwargs(sampling, self._eos_token_ids)
        input_ids = torch.tensor([request.prompt_token_ids], device=self.config.device)

        def run() -> None:
            try:
                with torch.inference_mode():
                    if sampling.seed is not None:
                        torch.manual_seed(sampling.seed)
                    self._model.generate(
                        input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        streamer=_QueueStreamer(loop, queue),
                        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
                        pad_token_id=self._eos_token_ids[0] if self._eos_token_ids else 0,
                        **kwargs,
                    )
            except BaseException as exc:  # surfaced to the consumer below
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        worker = loop.run_in_executor(None, run)
        detok = IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids)
        stop = StopStringMatcher(sampling.stop)
        stop_ids = set(kwargs["eos_token_id"] or [])
        num_out, first = 0, True
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finish = None
                if item is _DONE:
                    if cancel.is_set():
                        return  # aborted: the consumer is gone
                    item = []
                    finish = "length" if num_out >= sampling.max_tokens else "stop"
                num_out += len(item)
                text = stop.feed(detok.add([t for t in item if t not in stop_ids]))
                if stop.stopped or (item and item[-1] in stop_ids):
                    finish = "stop"
                elif finish is None and num_out >= sampling.max_tokens:
                    finish = "length"
                if finish is not None and not stop.stopped:
                    text += stop.feed(detok.flush()) + stop.flush()
                yield TokenDelta(
                    text=text,
                    token_ids=tuple(item),
                    finish_reason=finish,
                    num_prompt_tokens=len(request.prompt_token_ids) if first else 0,
                )
                first = False
                if finish is not None:
                    return
        finally:
            cancel.set()
            await worker
