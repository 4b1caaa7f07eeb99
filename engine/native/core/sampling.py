"""Checks of sampling parameters, and the per-request sampling state the engine keeps.

`SamplingParams` (engine.protocol) is the wire-level frozen record; here it is validated once
when a request enters the engine (bad values raise `EngineError` naming the parameter) and
turned into what the sampler and the stop checks need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragspeed.engine.native.core.logits_process import LogitsProcessor
from ragspeed.engine.protocol import MAX_LOGPROBS, EngineError, SamplingParams


def validate_sampling(params: SamplingParams, vocab_size: int) -> None:
    def bad(param: str, rule: str, value: object) -> EngineError:
        return EngineError(f"{param} must be {rule}, got {value!r}", param=param)

    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise bad("max_tokens", "an integer >= 1", params.max_tokens)
    if not params.temperature >= 0.0:
        raise bad("temperature", ">= 0", params.temperature)
    if not 0.0 < params.top_p <= 1.0:
        raise bad("top_p", "in (0, 1]", params.top_p)
    if not isinstance(params.top_k, int) or params.top_k < -1:
        raise bad("top_k", "an integer >= 0 (0 or -1 disables it)", params.top_k)
    if not 0.0 <= params.min_p <= 1.0:
        raise bad("min_p", "in [0, 1]", params.min_p)
    if params.logprobs is not None and (
        not isinstance(params.logprobs, int)
        or isinstance(params.logprobs, bool)
        or not 0 <= params.logprobs <= MAX_LOGPROBS
    ):
        raise bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", params.logprobs)
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad("stop_token_ids", f"token ids in [0, {vocab_size})", token_id)
    for token_id, bias in params.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise bad("logit_bias", f"keyed by token ids in [0, {vocab_size})", token_id)
        if not -100.0 <= bias <= 100.0:
            raise bad("logit_bias", "biases in [-100, 100]", bias)
    for param in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(params, param) <= 2.0:
            raise bad(param, "in [-2, 2]", getattr(params, param))
    if not params.repetition_penalty > 0.0:
        raise bad("repetition_penalty", "> 0", params.repetition_penalty)


@dataclass
class SamplingState:
    """What one request needs at every sampling step."""

    params: SamplingParams
    stop_token_ids: frozenset[int]  # stop ids plus eos unless ignore_eos
    generator: torch.Generator | None  # per-request seed: reproducible whatever the batch
    processor: LogitsProcessor | None = None  # where `params.processes_logits`

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        device: torch.device | str,
        processor: LogitsProcessor | None = None,
    ) -> SamplingState:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(params, frozenset(stop_ids), generator, processor)
