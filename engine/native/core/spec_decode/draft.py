"""Draft-model proposer: a small model with the target's tokenizer and its own paged KV cache.

The draft lives in the engine process beside the target: its own `ModelRunner` over its own
`KVCachePool` (the target's batch building and attention metadata, a second instance) and a
`KVCacheManager` with prefix caching off (draft KV is never shared). Per request it keeps
`num_computed` (leading tokens of the request's `all_token_ids` whose draft KV is in its blocks)
and `pending` (the drafts it fed after them last time: KV written, not yet verified).

One `propose_batch` call, for all running decodes of the step:
1. *rollback* of the last verification: pending drafts the target accepted (equal to the
   request's next tokens) become computed; the blocks beyond them are freed (`manager.trim`;
   stale slots in the last kept block are overwritten by the catch-up);
2. *catch-up*: one flat forward over each request's tokens the draft has not seen (the first
   time the whole prompt, as a prefill; then usually the last accepted draft and the bonus or
   recovered token); the greedy argmax at each request's last token is draft 1;
3. k - 1 decode steps, every request still drafting in one flat batch per step: drafts 2 .. k.
   The last draft is never fed, so the draft's KV reaches `num_tokens + k - 1` at most.
Where ragspeed's CPU kernels run the draft, 2 and 3 are one call of theirs (`_fused_steps`),
after a catch-up forward of its own when the catch-up is long (a new request's prompt).

A draft may carry a *sub-vocabulary head* (FR-Spec, arXiv 2502.14856): an LM head over the
`draft_vocab_size` most frequent tokens of its target's outputs, row i scoring target token
`d2t[i]` (engine.native.models.arch, engine.native.loading.loader). Its input embedding keeps the target's whole
vocabulary, so what it is fed and what it proposes are target ids: the argmax row is mapped
through `d2t` before it is a draft or the next input (in the fused kernels too). The head's
product is the draft step's largest (SmolLM2-135M's head is 576 x 49,152, a 2-layer draft's
layers 7M weights); a 4,096-token head is a twelfth of it.

Drafts are greedy, so the proposal q is a point mass on the draft: exactly the case the
rejection sampler (rejection.py) handles, "accept x with probability p(x), else draw from p
without x", which keeps the target's distribution for temperature > 0 (and greedy output
identical). A draft pool too full for a request's blocks means no drafts for it this step: the
draft never preempts anything. `release` (the scheduler's hook on finish, abort and preemption)
frees all of a request's draft blocks; a preempted request catches up from scratch later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.attention_metadata import SMALL_CHUNK_QUERIES, padded_tables
from ragspeed.engine.native.compute.quant import QuantizationUnavailableError, available_quantizations
from ragspeed.engine.native.core.kv_cache import KVCachePool
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.native.core.scheduler_output import ScheduledChunk, SchedulerOutput, TokenSequence
from ragspeed.engine.native.core.spec_decode.proposer import TargetParts
from ragspeed.engine.native.loading.loader import LoadedModel, load_for_engine, resolve_model_path
from ragspeed.engine.protocol import EngineError
from ragspeed.prompt_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)


@dataclass
class _DraftState:
    num_computed: int = 0  # leading request tokens with draft KV
    pending: list[int] = field(default_factory=list)  # drafts fed after them, unverified


class _Drafting(NamedTuple):
    """A request drafting this call."""

    row: int  # in the batch
    state: _DraftState
    block_table: tuple[int, ...]
    token_ids: list[int]  # the request's all_token_ids
    k: int  # drafts wanted

    @property
    def num_tokens(self) -> int:
        """The request's tokens; draft 1 goes at this position."""
        return len(self.token_ids)


class DraftProposer:
    name = "draft"

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        vocab_size: int | None = None,
        min_confidence: float = 0.0,
        num_threads: int | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.max_model_len = loaded.rotary.freqs_cis.shape[0]
        # A sub-vocabulary head (engine.native.models.arch.ModelArch.draft_vocab_size): head row i scores
        # target token d2t[i], [num_logits] int64; None: row i scores token i.
        self.d2t = loaded.model.d2t
        # The argmax runs over the first vocab_size logits: every row of a sub-vocabulary head
        # (its ids are checked at start-up), else the rows that are ids of the target's
        # vocabulary (embedding tables may be padded).
        self.vocab_size = (
            loaded.arch.num_logits
            if self.d2t is not None
            else min(loaded.arch.vocab_size, vocab_size or loaded.arch.vocab_size)
        )
        self.block_size = block_size
        # A request stops drafting after a draft the draft model gives less than this
        # probability: later drafts would rarely be accepted, and each costs a draft step.
        self.min_confidence = min_confidence
        # All steps in one call of the CPU kernels where they run the draft (_fused_steps).
        self.fused_steps = True
        # Time the latest propose_batch spent prefilling prompts (engine.native.core.spec_decode.proposer).
        self.setup_seconds = 0.0
        pool = KVCachePool(loaded.arch, num_blocks, block_size, loaded.model.dtype, device)
        # On the target's forward thread count (engine.native.core.model_runner), for the draft's steps too.
        self.runner = ModelRunner(loaded.model, loaded.rotary, pool, device, num_threads)
        self.manager = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self._states: dict[str, _DraftState] = {}

    @property
    def num_threads(self) -> int:
        return self.runner.num_threads

    @num_threads.setter
    def num_threads(self, num_threads: int) -> None:
        self.runner.num_threads = num_threads

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.manager.free(request_id)

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        self.setup_seconds = 0.0
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[_Drafting] = []
        chunks: list[ScheduledChunk] = []  # each request's catch-up
        for index, (request, k) in enumerate(zip(requests, num_tokens)):
            tokens = request.all_token_ids
            request_id = request.request_id
            state = self._states.setdefault(request_id, _DraftState())
            num_computed = state.num_computed
            for draft in state.pending:  # rollback: keep the accepted drafts' KV only
                if num_computed >= len(tokens) or tokens[num_computed] != draft:
                    break
                num_computed += 1
            # The last token is always fed again: its logits give draft 1.
            num_computed = min(num_computed, len(tokens) - 1)
            state.num_computed, state.pending = num_computed, []
            if self.manager.has_request(request_id):
                self.manager.trim(request_id, num_computed)
            needed = len(tokens) + k - 1
            if needed > self.max_model_len or self.manager.allocate_slots(request_id, needed) is None:
                continue  # the draft pool is full: no drafts for this request, nothing preempted
            table = self.manager.block_ids(request_id)
            active.append(_Drafting(index, state, table, tokens, k))
            chunks.append(TokenSequence(tokens).chunk(num_computed, len(tokens) - num_computed, table))
        if not active:
            return drafts

        self._draft(active, chunks, drafts)
        for a in active:
            a.state.num_computed = a.num_tokens
            a.state.pending = drafts[a.row][:-1]  # the fed drafts (the last one is not fed)
        return drafts

    def _draft(self, active: list[_Drafting], chunks: list[ScheduledChunk], drafts: list[list[int]]) -> None:
        """Greedy draft steps: `chunks` (the catch-up) gives draft 1 of every active request,
        then one flat decode step per further draft; appends to `drafts` in place."""
        fused = self.fused_steps and self.runner.runs_greedy_steps
        prefill = max(c.num_tokens for c in chunks) > SMALL_CHUNK_QUERIES  # a new request's prompt
        if fused and not prefill:
            fed = [c.request.all_token_ids[c.start :] for c in chunks]
            self._fused_steps(active, fed, [c.start for c in chunks], drafts)
            return
        going = active
        for step in range(max(a.k for a in active)):
            if step and fused:  # after a long catch-up (a prefill) forward
                fed = [[drafts[a.row][-1]] for a in going]
                self._fused_steps(going, fed, [a.num_tokens for a in going], drafts, 1)
                return
            if step:  # requests still drafting feed their latest draft: one flat batch
                chunks = [
                    TokenSequence(a.token_ids + drafts[a.row]).chunk(
                        a.num_tokens + step - 1, 1, a.block_table
                    )
                    for a in going
                ]
            start = time.perf_counter()
            new_tokens, confidences = self._forward(chunks)
            if prefill and not step:  # one-time work, not what drafting costs a step
                self.setup_seconds = time.perf_counter() - start
            for a, token in zip(going, new_tokens):
                drafts[a.row].append(token)
            going = [
                a
                for a, confidence in zip(going, confidences)
                if a.k > step + 1 and confidence >= self.min_confidence
            ]
            if not going:
                break

    def _fused_steps(
        self,
        going: list[_Drafting],
        fed: list[list[int]],
        positions: list[int],
        drafts: list[list[int]],
        skip: int = 0,
    ) -> None:
        """Drafts `skip` + 1 .. k of the requests `going`, after feeding each its `fed` tokens
        from `positions` on, in one call of ragspeed's CPU kernels
        (engine.native.compute.cpu_kernels.decoder): the same kernels as the step-by-step loop, without its
        Python, which for a draft this small is a large share of a step."""
        longest = max(a.num_tokens + a.k - 1 for a in going)
        tables = padded_tables([list(a.block_table) for a in going], -(-longest // self.block_size))
        steps = self.runner.greedy_steps(
            fed,
            positions,
            tables,
            [a.k - skip for a in going],
            vocab_size=self.vocab_size,
            d2t=self.d2t,
            min_confidence=self.min_confidence,
        )
        for a, tokens in zip(going, steps):
            drafts[a.row].extend(tokens)

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[float]]:
        """One forward of the draft's runner over `chunks`, each of which samples (it ends at its
        sequence's last token); returns the greedy next token after each chunk and its
        probability under the draft, in the order given."""
        # The runner's flat batch: one-token chunks (decodes) first, then the longer ones.
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens > 1)
        num_decodes = sum(1 for c in chunks if c.num_tokens == 1)
        batch = tuple(chunks[i] for i in order)
        logits = self.runner.execute(SchedulerOutput(batch[:num_decodes], batch[num_decodes:]))
        assert logits is not None, "every chunk ends at its sequence's last token, so it samples"
        logits = logits[:, : self.vocab_size]  # [chunks, vocab], in batch order
        if self.min_confidence > 0.0:
            best, next_ids = logits.softmax(dim=-1).max(dim=-1)
            probs = best.tolist()
        else:
            next_ids, probs = logits.argmax(dim=-1), [1.0] * len(chunks)
        if self.d2t is not None:  # head rows -> target token ids
            next_ids = self.d2t[next_ids]
        next_tokens = next_ids.tolist()
        tokens, confidences = [0] * len(chunks), [0.0] * len(chunks)
        for row, i in enumerate(order):
            tokens[i], confidences[i] = next_tokens[row], probs[row]
        return tokens, confidences


# ---------------------------------------------------------------------- start-up checks


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """Why two tokenizers would give different token ids (vocabulary or special tokens), or
    None when they agree."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(
            t for t in set(target_vocab) | set(draft_vocab) if target_vocab.get(t) != draft_vocab.get(t)
        )
        return (
            f"vocabularies differ ({len(target_vocab)} vs {len(draft_vocab)} tokens; "
            f"{len(differing)} tokens differ, e.g. {differing[:3]})"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(target, name, None) != getattr(draft, name, None):
            return f"{name} differs ({getattr(target, name, None)} vs {getattr(draft, name, None)})"
    target_special = dict(zip(target.all_special_tokens, target.all_special_ids))
    draft_special = dict(zip(draft.all_special_tokens, draft.all_special_ids))
    if target_special != draft_special:
        return f"special tokens differ ({target_special} vs {draft_special})"
    return None


def vocabulary_mismatch(target_vocab_size: int, draft: LoadedModel) -> str | None:
    """Why a draft cannot take every token id of a target with `target_vocab_size` embedding
    rows as input, or propose only ids of it; None when it can. (The draft's own map was
    checked against its own vocabulary at load: engine.native.loading.loader.check_d2t.)"""
    draft_vocab_size = draft.arch.vocab_size
    if draft_vocab_size < target_vocab_size:
        return (
            f"its embedding has {draft_vocab_size} rows, the target's vocabulary {target_vocab_size} tokens"
            " (input ids are the target's)"
        )
    d2t = draft.model.d2t
    if d2t is not None and int(d2t.max()) >= target_vocab_size:
        return (
            f"its sub-vocabulary map (d2t, {len(d2t)} ids) holds id {int(d2t.max())},"
            f" outside the target's vocabulary of {target_vocab_size} tokens"
        )
    return None


def draft_quantization(config: EngineConfig) -> str | None:
    """The draft's weight quantization. `auto`: int8 on a CPU where it runs, else the target's.
    A draft step reads all the draft's weights, like a target step reads the target's, and
    the draft's precision moves only its acceptance, never the output (the target verifies).
    int8 weights are a quarter of fp32's bytes, and a distilled draft's argmax (drafts are
    greedy) rarely changes under int8."""
    if config.draft_quantization != "auto":
        return config.draft_quantization
    cpu = config.device == "cpu" and "int8" in available_quantizations("cpu")
    return "int8" if cpu else config.quantization


def build_draft_proposer(config: EngineConfig, target: TargetParts) -> DraftProposer:
    """Load `config.draft_model` like the target (device, dtype) with its own quantization
    (`draft_quantization`), check that it shares the target's tokenizer, and give it a pool of
    as many tokens as the target's."""
    from transformers import AutoTokenizer

    from ragspeed.engine.native.loading.model_zoo import ModelUnavailableError

    name = config.draft_model
    assert name is not None, "the proposer's factory names the draft"
    try:
        path = resolve_model_path(name)
    except ModelUnavailableError as error:  # e.g. a trained draft not built yet: says how
        raise EngineError(f"{error} (the draft of {config.model!r})", param="draft_model") from error
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise EngineError(
            f"draft model {name!r}: cannot load its tokenizer ({error})", param="draft_model"
        ) from error
    mismatch = tokenizer_mismatch(target.tokenizer, draft_tokenizer)
    if mismatch is not None:
        raise EngineError(
            f"draft model {name!r} does not share the tokenizer of the target model"
            f" {config.model!r}: {mismatch}; a draft must use the target's tokenizer",
            param="draft_model",
        )
    num_threads = target.runner.num_threads
    quantization = draft_quantization(config)
    try:
        loaded = load_for_engine(
            path,
            replace(config, quantization=quantization),
            max_model_len=target.max_model_len,
            num_threads=num_threads,
        )
    except QuantizationUnavailableError as error:
        raise EngineError(f"draft model {name!r}: {error}", param="draft_quantization") from error
    except (KeyError, ValueError) as error:
        raise EngineError(
            f"draft model {name!r} (for target model {config.model!r}): {error}", param="draft_model"
        ) from error
    mismatch = vocabulary_mismatch(target.vocab_size, loaded)
    if mismatch is not None:
        raise EngineError(
            f"draft model {name!r} does not fit the vocabulary of the target model {config.model!r}: {mismatch}",
            param="draft_model",
        )
    proposer = DraftProposer(
        loaded,
        num_blocks=target.manager.num_blocks,
        block_size=config.block_size,
        device=config.device,
        vocab_size=target.vocab_size,
        num_threads=num_threads,
    )
    logger.info(
        "draft model %s (%d layers, LM head %d tokens, weights %s), KV pool %d blocks x %d tokens (%.0f MiB)",
        name,
        loaded.arch.num_layers,
        loaded.arch.num_logits,
        quantization or "unquantized",
        proposer.manager.num_blocks,
        config.block_size,
        proposer.runner.kv_pool.num_bytes / 2**20,
    )
    return proposer
