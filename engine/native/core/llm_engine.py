"""The native engine's synchronous core: admit requests, run steps, emit deltas.

One `step()` = schedule (continuous batching, chunked prefill, preemption) -> one forward pass
over the flat batch -> sample the requests whose chunk reached their last token -> append,
detokenize, check stops -> finished requests give their blocks back at once. Everything here
runs on one thread; `engine.backends.native` drives it from a background thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.detokenizer import IncrementalDetokenizer
from ragspeed.engine.native.core.document_kv import DocumentKVCache, document_fingerprint, open_document_store
from ragspeed.engine.native.core.logits_process import LogitsProcessor
from ragspeed.engine.native.core.logprobs import token_logprobs
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.native.core.precision import PrefillChoice
from ragspeed.engine.native.core.prefix_store import engine_fingerprint
from ragspeed.engine.native.core.request import Request
from ragspeed.engine.native.core.sampler import Sampler
from ragspeed.engine.native.core.sampling import SamplingState, validate_sampling
from ragspeed.engine.native.core.scheduler import Scheduler, StepTimeModel
from ragspeed.engine.native.core.scheduler_output import ScheduledChunk, SchedulerOutput
from ragspeed.engine.native.core.spec_decode import TargetParts, build_speculator
from ragspeed.engine.native.core.structured import GrammarCompiler
from ragspeed.engine.native.loading.loader import LoadedModel
from ragspeed.engine.native.models.linear import decode_weights
from ragspeed.engine.native.models.memory import resident_weight_bytes, unquantized_weight_bytes
from ragspeed.engine.protocol import (
    EngineError,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    check_context_length,
)
from ragspeed.prompt_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    delta: TokenDelta


class LLMEngine:
    """The engine over its parts, built by engine.native.core.factory.build_llm_engine: the loaded model
    (its precision chosen), its tokenizer, the model runner over the KV pool and the manager of
    the pool's blocks. Here they are wired to the scheduler, the sampler, the speculator and
    the document cache."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel,
        tokenizer: Any,
        runner: ModelRunner,
        manager: KVCacheManager,
        prefill_choice: PrefillChoice | None = None,  # None off CPU
    ):
        self.config = config
        self.device = torch.device(config.device)
        self.prefill_choice = prefill_choice
        self.loaded = loaded
        self.tokenizer = tokenizer
        self.arch = loaded.arch
        self.model_name = config.model
        self.max_model_len = loaded.rotary.freqs_cis.shape[0]
        self.eos_token_ids = loaded.eos_token_ids
        self.runner = runner
        runner.int16_attention = prefill_choice is not None and prefill_choice.int16_attention
        self.kv_pool = runner.kv_pool
        self.manager = manager
        self.scheduler = Scheduler(
            self.manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            step_seconds=None if config.tpot_target_ms is None else config.tpot_target_ms / 1000,
            step_time=StepTimeModel(threads=runner.num_threads),
            min_prefill_tokens=config.block_size,
        )
        self.sampler = Sampler(config.device, seed=config.seed)
        self.grammars = GrammarCompiler(tokenizer, self.arch.vocab_size, self.eos_token_ids)
        target = TargetParts(self.runner, self.manager, tokenizer, self.arch.vocab_size, self.max_model_len)
        self.speculator = build_speculator(config, target)  # None unless config.speculative
        if self.speculator is not None:
            self.scheduler.release_hooks.append(self.speculator.release)
        self.documents = self._document_cache(config)
        self.num_steps = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # What the weights are and which products read them: start-up log, GET /v1/models.
        resident_bytes = resident_weight_bytes(loaded.model)
        self.weights: dict[str, str | int | None] = {
            "quantization": loaded.quantization or "none",
            "decode": decode_weights(loaded.model),
            "prefill": None if self.prefill_choice is None else self.prefill_choice.name,
            "resident_bytes": resident_bytes,
        }
        logger.info(
            "native engine: %s (%s), KV pool %d blocks x %d tokens (%s, %.0f MiB); weights %s, "
            "decode reads %s, %.0f MiB resident",
            config.model,
            self.arch.family,
            manager.num_blocks,
            config.block_size,
            str(self.kv_pool.kv.dtype).removeprefix("torch."),
            self.kv_pool.num_bytes / 2**20,
            self.weights["quantization"],
            self.weights["decode"],
            resident_bytes / 2**20,
        )

    def _document_cache(self, config: EngineConfig) -> DocumentKVCache | None:
        """Document KV reuse, where this model's keys can be moved (its rope shifts)."""
        if not self.runner.rotary.shiftable:
            logger.info(
                "document KV reuse is off: rope type %r cannot be shifted; documents are prefilled in full",
                self.runner.rotary.rope_type,
            )
            return None
        fingerprint = document_fingerprint(engine_fingerprint(self), config.document_cache_dtype)
        store = open_document_store(config, fingerprint, self.kv_pool.kv.shape)
        documents = DocumentKVCache(
            store,
            fingerprint=fingerprint,
            runner=self.runner,
            make_prefill=self._document_prefill,
            storage_dtype=config.document_cache_dtype,
        )
        self.scheduler.assemble = documents.assemble
        self.scheduler.release_hooks.append(documents.release)
        return documents

    def _document_prefill(self, request_id: str, token_ids: list[int], cache_salt: str | None) -> Request:
        request = GenerationRequest(
            request_id, tuple(token_ids), SamplingParams(max_tokens=1), cache_salt=cache_salt
        )
        state = SamplingState.create(request.sampling, self.eos_token_ids, self.device)
        return Request(request, state, detokenizer=None, prefill_only=True)

    # ------------------------------------------------------------------ requests

    def validate(self, request: GenerationRequest, *, prefill_only: bool = False) -> None:
        """Raise EngineError for a request the engine can never serve. Thread-safe."""
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise EngineError("the prompt is empty", param="messages")
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise EngineError(f"prompt token ids must be in [0, {vocab})", param="messages")
        max_tokens = 0 if prefill_only else request.sampling.max_tokens
        if not prefill_only:
            validate_sampling(request.sampling, vocab)
            if request.sampling.structured is not None:
                self.grammars.compile(request.sampling.structured)  # a 400 for a bad constraint
        check_context_length(num_prompt, max_tokens, self.max_model_len)
        end = 0
        for start, stop in request.document_spans:
            if not end <= start < stop <= num_prompt:
                raise EngineError(
                    f"document spans must be ascending, non-empty and within the prompt's {num_prompt} tokens",
                    param="document_spans",
                )
            end = stop

    def add_request(
        self, request: GenerationRequest, *, prefill_only: bool = False, pin: bool = False
    ) -> None:
        """Queue a request. `prefill_only` fills the prefix cache and samples nothing; with `pin`
        its full blocks are pinned as it finishes, in the same step (nothing can evict them
        between the prefill and the pin)."""
        self.validate(request, prefill_only=prefill_only)
        self.add_validated(request, prefill_only=prefill_only, pin=pin)

    def add_validated(
        self, request: GenerationRequest, *, prefill_only: bool = False, pin: bool = False
    ) -> None:
        """`add_request` for a request that `validate` passed with the same `prefill_only`: the
        native backend validates on the event loop, so that a refusal raises before anything
        is queued, and queues it on the engine thread without a second validation."""
        if pin and not prefill_only:
            raise ValueError("pin needs prefill_only")
        if self.scheduler.get(request.request_id) is not None:
            raise EngineError(f"request_id {request.request_id!r} is already running", param="request_id")
        state = SamplingState.create(
            request.sampling, self.eos_token_ids, self.device, self._processor(request, prefill_only)
        )
        detokenizer = None
        if not prefill_only:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        engine_request = Request(request, state, detokenizer=detokenizer, prefill_only=prefill_only, pin=pin)
        if self.documents is not None and request.document_cache is not None and request.document_spans:
            for prefill in self.documents.plan(
                engine_request, request.document_cache, request.document_spans
            ):
                prefill.priority = engine_request.priority  # queued as the request they serve
                self.scheduler.add(prefill)  # ahead of the request, which waits on them
        self.scheduler.add(engine_request)

    def _processor(self, request: GenerationRequest, prefill_only: bool) -> LogitsProcessor | None:
        params = request.sampling
        if prefill_only or not params.processes_logits:
            return None
        matcher = None if params.structured is None else self.grammars.matcher(params.structured)
        return LogitsProcessor(params, request.prompt_token_ids, matcher)

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request and free its blocks now; unknown ids are ignored (None)."""
        request = self.scheduler.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        return StepOutput(request_id, TokenDelta(text="", finish_reason="abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_threads(self) -> int:
        """Threads of the next step's forward pass (the kernels' and torch's)."""
        return self.runner.num_threads

    def use_threads(self, num_threads: int) -> None:
        """Run the next steps on `num_threads` threads (fewer while a helper job holds the
        others: engine.backends.native.CpuBudget); the model's and a draft model's passes."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.runner.num_threads = num_threads
        self.scheduler.step_time.threads = num_threads
        proposer = getattr(self.speculator, "proposer", None)
        if proposer is not None and hasattr(proposer, "num_threads"):
            proposer.num_threads = num_threads

    # ------------------------------------------------------------------ steps

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        if self.documents is not None and self.documents.orphans:
            orphans, self.documents.orphans = self.documents.orphans, []
            for request_id in orphans:
                self.abort(request_id)
        if self.speculator is not None:
            self.speculator.propose(
                self.scheduler.running,
                self.max_model_len,
                num_waiting=len(self.scheduler.waiting),
            )
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        results = self._run_step(output)
        # Every step feeds the model that sizes the prefill chunks beside decodes.
        num_prefill = output.num_prefill_tokens
        self.scheduler.step_time.observe(
            output.num_tokens - num_prefill, num_prefill, time.perf_counter() - start
        )
        if self.speculator is not None and all(c.num_real_tokens == 1 for c in output.chunks):
            # A step of decodes only: its cost tells the controller whether speculating pays.
            self.speculator.observe_step(time.perf_counter() - start)
        return results

    def _run_step(self, output: SchedulerOutput) -> list[StepOutput]:
        self.num_steps += 1
        logits = self.runner.execute(output)
        self.scheduler.update_computed(output)
        results: list[StepOutput] = []
        new_token_ids: dict[str, list[int]] = {}
        sampling = [c.request for c in output.chunks if c.samples]
        if logits is not None and any(c.draft_token_ids for c in output.chunks):
            new_token_ids = self._sample_speculative(output.chunks, logits, results)
        elif logits is not None:
            tokens = self.sampler(logits, [r.sampling for r in sampling])
            logprobs = _logprobs(logits, list(range(len(tokens))), sampling, tokens)
            for request, token, logprob in zip(sampling, tokens, logprobs):
                new_token_ids[request.request_id] = [token]
                results.append(self._append_token(request, token, logprob))
        self.scheduler.update_from_output(output, new_token_ids)
        for chunk in output.chunks:  # a prefill-only request's last chunk may be one token
            request = chunk.request
            if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                if request.document_key is not None:  # a document prefill: nobody streams it
                    assert self.documents is not None, "document prefills come from the document cache"
                    self.documents.capture(request, self.manager.block_table(request.request_id))
                    self.scheduler.finish(request, "stop")
                    continue
                pinned: tuple[int, ...] = ()
                if request.pin:  # before finish: the request still holds its blocks
                    pinned = tuple(self.manager.pin(request.prompt_token_ids, request.cache_salt))
                self.scheduler.finish(request, "stop")
                # warm(): report how much of the prefix is now cached (its blocks stay cached);
                # store_documents(): what became of the documents.
                num_cached = self.num_cached_prefix_tokens(request.prompt_token_ids, request.cache_salt)
                delta = TokenDelta(
                    text="",
                    finish_reason="stop",
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=num_cached,
                    documents=request.document_plan.report() if request.document_plan else None,
                    pinned_block_ids=pinned,
                )
                results.append(StepOutput(request.request_id, delta))
        return results

    def _sample_speculative(
        self, chunks: tuple[ScheduledChunk, ...], logits: torch.Tensor, results: list[StepOutput]
    ) -> dict[str, list[int]]:
        """A step with draft tokens: logits [num_sampling_rows, vocab] hold one row per plain
        sampling chunk and 1 + k rows per decode with k drafts (engine.native.core.model_runner). Appends
        the tokens (deltas into `results`); returns request id -> the tokens sampled or verified,
        for the scheduler to commit the accepted drafts."""
        plain: list[tuple[ScheduledChunk, int]] = []
        spec: list[tuple[ScheduledChunk, int]] = []
        row = 0
        for chunk in (c for c in chunks if c.samples):
            (spec if chunk.draft_token_ids else plain).append((chunk, row))
            row += 1 + len(chunk.draft_token_ids)
        new_tokens: dict[str, list[int]] = {}
        if plain:
            rows = torch.tensor([r for _, r in plain], device=logits.device)
            sampled = self.sampler(logits[rows], [c.request.sampling for c, _ in plain])
            new_tokens.update({c.request.request_id: [t] for (c, _), t in zip(plain, sampled)})
        for chunk, first in spec:
            assert self.speculator is not None, "draft tokens come from the speculator"
            rows_k = logits[first : first + 1 + len(chunk.draft_token_ids)]  # [1 + k, vocab]
            new_tokens[chunk.request.request_id] = self.speculator.verify(
                chunk.request, chunk.draft_token_ids, rows_k, self.sampler.generator
            )
        # Appended token j of a request was drawn (or verified) at row first + j: accepted
        # drafts and the recovered or bonus token all carry the target's own logprobs.
        picks = [
            (first + j, chunk.request, token)
            for chunk, first in plain + spec
            for j, token in enumerate(new_tokens[chunk.request.request_id])
        ]
        pick_rows, pick_requests, pick_tokens = (list(column) for column in zip(*picks))
        logprobs: dict[str, list[TokenLogprob | None]] = {}
        computed = _logprobs(logits, pick_rows, pick_requests, pick_tokens)
        for request, logprob in zip(pick_requests, computed):
            logprobs.setdefault(request.request_id, []).append(logprob)
        for chunk, _ in sorted(plain + spec, key=lambda item: item[1]):
            request = chunk.request
            tokens = new_tokens[request.request_id]
            for token, logprob in zip(tokens, logprobs[request.request_id]):
                results.append(self._append_token(request, token, logprob))
                if request.is_finished:
                    break
        return new_tokens

    def _first_delta(
        self,
        request: Request,
        text: str,
        token_ids: tuple[int, ...],
        finish: str | None,
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> TokenDelta:
        first = not request.first_delta_sent
        request.first_delta_sent = True
        if first:
            self.num_prompt_tokens_total += request.num_prompt_tokens
        return TokenDelta(
            text=text,
            token_ids=token_ids,
            finish_reason=finish,
            num_prompt_tokens=request.num_prompt_tokens if first else 0,
            num_cached_tokens=max(request.num_cached_tokens, 0) if first else 0,
            logprobs=logprobs,
            documents=request.document_plan.report() if first and request.document_plan else None,
        )

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> StepOutput:
        detokenizer = request.detokenizer
        assert detokenizer is not None, "a request that samples has a detokenizer"
        request.all_token_ids.append(token)
        self.num_generation_tokens_total += 1
        params = request.sampling.params
        processor = request.sampling.processor
        finish: str | None = None
        text = ""
        if token in request.sampling.stop_token_ids:
            finish = "stop"  # the stop token's text is not part of the output
        else:
            if processor is not None:
                processor.accept(token)
            text = request.stop_matcher.feed(detokenizer.add([token]))
            if request.stop_matcher.stopped or (processor is not None and processor.is_complete):
                finish = "stop"
        if finish is None and (
            request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len
        ):
            finish = "length"
        if finish is not None:
            if not request.stop_matcher.stopped:
                text += request.stop_matcher.feed(detokenizer.flush())
                text += request.stop_matcher.flush()
            self.scheduler.finish(request, finish)
        logprobs = None if logprob is None else (logprob,)
        delta = self._first_delta(request, text, (token,), finish, logprobs)
        return StepOutput(request.request_id, delta)

    # ------------------------------------------------------------------ helpers

    def num_cached_prefix_tokens(self, token_ids: list[int] | tuple[int, ...], cache_salt: str | None) -> int:
        """Tokens of `token_ids` (full blocks, the last one included) now in the prefix cache."""
        # get_computed_blocks leaves the last token to compute: a sentinel makes it count them all.
        _, num_cached = self.manager.get_computed_blocks(
            list(token_ids) + [0], cache_salt, record_stats=False
        )
        return num_cached

    @property
    def prefill_path(self) -> str | None:
        """The name of the prefill path serving this model (None off CPU)."""
        return None if self.prefill_choice is None else self.prefill_choice.path.name

    def stats(self) -> dict[str, float]:
        cache = self.manager.stats()
        step_time = self.scheduler.step_time
        return {
            "num_blocks_total": float(self.manager.num_blocks),
            "num_blocks_free": float(self.manager.num_free_blocks),
            "num_blocks_used": float(self.manager.num_blocks - self.manager.num_free_blocks),
            "kv_cache_usage": float(self.manager.usage),
            "prefix_cache_queries_tokens": float(cache.queries_tokens),
            "prefix_cache_hits_tokens": float(cache.hits_tokens),
            "prefix_cache_cached_blocks": float(cache.num_cached_blocks),
            "num_requests_running": float(len(self.scheduler.running)),
            "num_requests_waiting": float(len(self.scheduler.waiting)),
            "num_preemptions": float(self.scheduler.num_preemptions),
            "num_steps": float(self.num_steps),
            # The measured step-time model (engine.native.core.scheduler.StepTimeModel); absent until measured.
            **{
                name: value
                for name, value in (
                    ("step_decode_seconds", step_time.decode_seconds),
                    ("step_seconds_per_prefill_token", step_time.seconds_per_prefill_token),
                )
                if value is not None
            },
            "prompt_tokens_total": float(self.num_prompt_tokens_total),
            "generation_tokens_total": float(self.num_generation_tokens_total),
            "weight_bytes": float(resident_weight_bytes(self.loaded.model)),
            "weight_bytes_unquantized": float(unquantized_weight_bytes(self.loaded.model)),
            **(self.speculator.metrics() if self.speculator is not None else {}),
            **(self.documents.stats() if self.documents is not None else {}),
        }

    def generate(self, requests: list[GenerationRequest]) -> dict[str, dict[str, Any]]:
        """Run requests to completion (tests, benchmarks): id -> token_ids, text, finish_reason
        (and logprobs, a list of TokenLogprob, for requests that asked)."""
        results: dict[str, dict[str, Any]] = {}
        for request in requests:
            self.add_request(request)
            results[request.request_id] = {"token_ids": [], "text": "", "finish_reason": None}
            if request.sampling.logprobs is not None:
                results[request.request_id]["logprobs"] = []
        while self.has_unfinished():
            for out in self.step():
                entry = results[out.request_id]
                entry["token_ids"].extend(out.delta.token_ids)
                if out.delta.logprobs is not None:
                    entry["logprobs"].extend(out.delta.logprobs)
                entry["text"] += out.delta.text
                if out.delta.finish_reason is not None:
                    entry["finish_reason"] = out.delta.finish_reason
                if out.delta.num_prompt_tokens:
                    entry["num_cached_tokens"] = out.delta.num_cached_tokens
        return results


def _logprobs(
    logits: torch.Tensor, rows: list[int], requests: list[Request], tokens: list[int]
) -> list[TokenLogprob | None]:
    """For each i, token `tokens[i]` of `requests[i]` was sampled from `logits[rows[i]]`: its
    TokenLogprob where the request asked, else None; nothing is computed when nobody asked."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    # (i, the alternatives request i wants) for the requests that asked
    wanted = [(i, n) for i, r in enumerate(requests) if (n := r.sampling.params.logprobs) is not None]
    if wanted:
        computed = token_logprobs(
            logits,
            [rows[i] for i, _ in wanted],
            [tokens[i] for i, _ in wanted],
            [n for _, n in wanted],
        )
        for (i, _), logprob in zip(wanted, computed):
            out[i] = logprob
    return out
