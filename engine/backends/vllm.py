"""The vLLM backend: the same `EngineClient` over vLLM's async engine, where vLLM is importable.

ragspeed's `EngineConfig` is mapped onto vLLM's engine arguments by `vllm_engine_args` and its
`SamplingParams` by `vllm_sampling_kwargs`: pure functions, unit-tested on every machine; the
engine itself runs only where `vllm` is installed (GPU machines, `pip install ragspeed[gpu]`).

Mapping notes:
- `num_kv_cache_tokens` -> `num_gpu_blocks_override`; otherwise vLLM sizes its pool from
  `gpu_memory_utilization` (its default), since vLLM counts weights and KV together.
- `quantization="int8"`: vLLM has no on-the-fly int8 for dense checkpoints; its on-the-fly
  8-bit weights are `fp8` (Hopper and newer), which is what ragspeed asks for.
- `speculative="ngram"` -> prompt-lookup proposer; `"draft"` -> `draft_model` as the proposer;
  an explicit `draft_quantization` is mapped like `quantization`, `"auto"` leaves vLLM's default.
- `SamplingParams.logprobs` -> vLLM's `logprobs` (the sampled token's logprob plus that many
  alternatives); vLLM's default `logprobs_mode="raw_logprobs"` reports the same distribution as
  the native engine (engine.native.core.logprobs). Its per-token dicts come back as `TokenLogprob`s
  through `vllm_token_logprobs`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from typing import Any

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.loading.model_zoo import resolve_tokenizer
from ragspeed.engine.protocol import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    check_context_length,
)

# ragspeed quantization -> vLLM `quantization`
QUANTIZATION_MAP: dict[str | None, str | None] = {None: None, "auto": None, "int8": "fp8"}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def speculative_config(config: EngineConfig) -> dict[str, Any] | None:
    if config.speculative is None:
        return None
    if config.num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {config.num_speculative_tokens}")
    if config.speculative == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": config.num_speculative_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 1,
        }
    if config.speculative == "draft":
        if not config.draft_model:
            raise ValueError("speculative='draft' needs draft_model")
        spec = {"model": config.draft_model, "num_speculative_tokens": config.num_speculative_tokens}
        if config.draft_quantization != "auto":
            if config.draft_quantization not in QUANTIZATION_MAP:
                known = ", ".join(repr(k) for k in QUANTIZATION_MAP)
                raise ValueError(f"unknown draft_quantization {config.draft_quantization!r}; known: {known}")
            if QUANTIZATION_MAP[config.draft_quantization] is not None:
                spec["quantization"] = QUANTIZATION_MAP[config.draft_quantization]
        return spec
    raise ValueError(f"unknown speculative method {config.speculative!r}; known: 'ngram', 'draft'")


def vllm_engine_args(config: EngineConfig, model_path: str) -> dict[str, Any]:
    """Keyword arguments of `vllm.AsyncEngineArgs` for this config (`model_path`: local dir)."""
    if config.quantization not in QUANTIZATION_MAP:
        known = ", ".join(repr(k) for k in QUANTIZATION_MAP)
        raise ValueError(f"unknown quantization {config.quantization!r}; known: {known}")
    args: dict[str, Any] = {
        "model": model_path,
        "tokenizer": resolve_tokenizer(config.tokenizer, model_path),
        "dtype": config.dtype,
        "seed": config.seed,
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": True,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    if config.max_model_len is not None:
        args["max_model_len"] = config.max_model_len
    if config.num_kv_cache_tokens is not None:
        args["num_gpu_blocks_override"] = config.num_kv_cache_tokens // config.block_size
    quantization = QUANTIZATION_MAP[config.quantization]
    if quantization is not None:
        args["quantization"] = quantization
    spec = speculative_config(config)
    if spec is not None:
        args["speculative_config"] = spec
    return args


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams`."""
    kwargs: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1 disables in every vLLM version
        "min_p": params.min_p,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }
    if params.logprobs is not None:
        kwargs["logprobs"] = params.logprobs
    return kwargs


def vllm_token_logprobs(
    token_ids: tuple[int, ...], entries: list[dict[int, Any]], num_top: int
) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token logprob dicts (token id -> object with `.logprob` and `.rank`, 1 for
    the most likely; the sampled token is always present, ranked wherever it fell) ->
    TokenLogprobs whose `top` holds the `num_top` best ranked, most likely first."""
    out = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None)
        top = tuple((t, logprob) for rank, t, logprob in ranked if rank <= num_top)
        out.append(TokenLogprob(token_id, entry[token_id].logprob, top))
    return tuple(out)


class VLLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.model
        self.max_model_len = config.max_model_len or 0
        self._engine: Any = None
        self._tokenizer: Any = None
        self._num_requests = 0

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self) -> None:
        if not vllm_available():
            raise EngineError(
                "backend 'vllm' needs the vllm package (GPU machines: pip install ragspeed[gpu])",
                code="engine_not_ready",
            )
        from vllm import AsyncEngineArgs

        try:
            from vllm.v1.engine.async_llm import AsyncLLM as engine_cls
        except ImportError:  # older vLLM
            from vllm import AsyncLLMEngine as engine_cls

        from ragspeed.engine.native.loading.loader import resolve_model_path

        path = str(resolve_model_path(self.config.model))
        args = AsyncEngineArgs(**vllm_engine_args(self.config, path))
        self._engine = engine_cls.from_engine_args(args)
        self._tokenizer = await self._engine.get_tokenizer()
        model_config = await self._engine.get_model_config()
        self.max_model_len = model_config.max_model_len

    async def shutdown(self) -> None:
        if self._engine is not None and hasattr(self._engine, "shutdown"):
            self._engine.shutdown()
        self._engine = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        from vllm import SamplingParams as VllmSamplingParams

        num_prompt = len(request.prompt_token_ids)
        check_context_length(num_prompt, request.sampling.max_tokens, self.max_model_len)
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        params = VllmSamplingParams(**vllm_sampling_kwargs(request.sampling))
        self._num_requests += 1
        num_ids = num_chars = 0
        finished = False
        try:
            async for out in self._engine.generate(prompt, params, request.request_id):
                completion = out.outputs[0]  # cumulative text and token ids
                ids = tuple(completion.token_ids[num_ids:])
                text = completion.text[num_chars:]
                first = num_ids == 0 and num_chars == 0
                num_ids, num_chars = len(completion.token_ids), len(completion.text)
                finished = completion.finish_reason is not None
                logprobs = None
                if request.sampling.logprobs is not None:
                    entries = list(completion.logprobs or [])[num_ids - len(ids) : num_ids]
                    logprobs = vllm_token_logprobs(ids, entries, request.sampling.logprobs)
                yield TokenDelta(
                    text=text,
                    token_ids=ids,
                    finish_reason=completion.finish_reason if finished else None,
                    num_prompt_tokens=num_prompt if first else 0,
                    num_cached_tokens=(getattr(out, "num_cached_tokens", 0) or 0) if first else 0,
                    logprobs=logprobs,
                )
        finally:
            if not finished:
                await self._engine.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def warm(self, prefix_token_ids: tuple[int, ...], cache_salt: str | None = None) -> int:
        if not self.config.enable_prefix_caching or not prefix_token_ids:
            return 0
        self._num_requests += 1
        request = GenerationRequest(
            request_id=f"warm-{self._num_requests}",
            prompt_token_ids=tuple(prefix_token_ids),
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            cache_salt=cache_salt,
        )
        async for _ in self.generate(request):
            pass
        return len(prefix_token_ids) // self.config.block_size * self.config.block_size

    async def store_documents(self, request: GenerationRequest) -> None:
        return None  # vLLM keeps no document KV (its prefix cache serves leading prefixes only)

    def stats(self) -> dict[str, float]:
        return {"requests_total": float(self._num_requests)}

    def prefix_cache(self) -> None:
        return None  # vLLM caches prefixes but offers no pins


__all__ = [
    "VLLMEngine",
    "vllm_available",
    "vllm_engine_args",
    "vllm_sampling_kwargs",
    "vllm_token_logprobs",
]
