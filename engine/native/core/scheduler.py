"""Continuous batching with chunked prefill under one token budget per step (vLLM v1 style).

Each step:
1. Running requests get their tokens first, decodes before prefill chunks, each in arrival
   order, within `max_num_batched_tokens`. When the pool cannot give a request its next block,
   the latest-arrived running request is preempted by recompute: its blocks are freed and it
   goes back to the FRONT of the waiting queue, to be prefilled again (prompt + output so far)
   later; if the one that needs the block is itself the latest, it is the one preempted.
   A decode carrying draft tokens (`request.spec_token_ids`, engine.native.core.spec_decode) is scheduled
   as 1 + k queries when the budget and the pool allow, else as a plain decode: drafts are
   trimmed to the budget and never cause a preemption.
2. If nothing was preempted, waiting requests are admitted strictly in queue order (the head
   of the queue blocks those behind it, so nobody starves; the order: Priority, below) while
   the budget, the pool and `max_num_seqs` allow, starting from their prefix-cache hit. A
   request still waiting on its documents' prefills (`request.blockers`) holds the queue; one
   with a document plan gets blocks for its whole prompt and is handed to the `assemble` hook
   (engine.native.core.document_kv), which places its stored documents and returns the positions left to
   compute, its last among them: its first chunk is those positions, *scattered* (each query
   sees the keys up to its own position).
3. After the forward pass, `update_computed` commits each chunk's real tokens (their full blocks
   enter the prefix cache, before a request that finishes this step frees them); after the
   engine appended the sampled tokens, `update_from_output` commits the accepted drafts and
   drops the rejected ones' blocks (vLLM's `Scheduler.update_from_output`).

The step's time budget (stall-free batching, Sarathi-Serve): a step that carries decodes must
finish within `step_seconds` (EngineConfig.tpot_target_ms), or every stream in flight waits on
the prefill chunks beside its decode. So once the decodes (drafts included) are scheduled, the
prefill chunks of the step (running prefills, then admissions) share at most the tokens that
the `StepTimeModel`, measured on the engine's own steps, says fit in what is left of the budget:
    step seconds ~= decode_seconds + num_prefill_tokens * seconds_per_prefill_token
and never fewer than `min_prefill_tokens` (a block), so a prefill always progresses, however
many decodes share the step. A step with no decodes keeps the whole token budget, and so does
every step until the model has measured a step with prefill tokens (or with `step_seconds`
None). Both limits hold: the token budget caps the time budget's chunk.

Priority: the waiting queue is ordered by (priority, arrival): an interactive request
(PRIORITY_INTERACTIVE, 0) goes ahead of the batch requests (PRIORITY_BATCH, 1) waiting, but
at most `max_overtakes` interactive entries (a request, or one of the document prefills queued
ahead of it) overtake one batch request; after that it holds its place, as an interactive one
would (no starvation: with the default 8, a batch request waits behind at most 8 later
interactive arrivals). A request preempted (for memory, the
only reason to preempt) still goes back to the front, whatever its priority; running requests
are never preempted for priority.

The scheduler talks to the `KVCacheManager` only: block ids, never the pool's tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from ragspeed.engine.native.core.request import Request, RequestStatus
from ragspeed.engine.native.core.scheduler_output import ScheduledChunk, SchedulerOutput
from ragspeed.engine.protocol import PRIORITY_INTERACTIVE
from ragspeed.prompt_cache.manager import KVCacheManager


class StepTimeModel:
    """What a step costs, measured on the engine's own steps (exponential moving averages):
        seconds ~= decode_seconds + num_prefill_tokens * seconds_per_prefill_token
    `decode_seconds` from steps of decodes alone; the per-token cost from steps with prefill
    tokens, beside decodes (what the decodes do not explain) or, until such a step was seen,
    alone. The fit need not separate a prefill pass's fixed cost from its per-token cost: a
    chunk sized from the last steps' per-token cost moves towards the size whose step takes
    exactly the budget (a step over budget raises the per-token cost, one under lowers it).

    Each thread count of the steps (`threads`, which the engine sets: fewer while compression
    holds one of its threads) has its own costs. A count not measured yet takes another's,
    its per-token cost scaled by the ratio of the counts (prefill is bound by compute), so a
    step on one thread of two gets half the chunk, not a chunk that takes twice the budget."""

    def __init__(self, *, smoothing: float = 0.3, threads: int = 1):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.threads = threads
        self._decode: dict[int, float] = {}  # threads -> seconds of a step of decodes alone
        self._beside: dict[int, float] = {}  # threads -> seconds a prefill token, beside decodes
        self._alone: dict[int, float] = {}  # threads -> seconds a prefill token, alone

    def _average(self, costs: dict[int, float], value: float) -> None:
        previous = costs.get(self.threads)
        costs[self.threads] = value if previous is None else previous + self.smoothing * (value - previous)

    @property
    def decode_seconds(self) -> float | None:
        decode = self._decode
        if self.threads in decode or not decode:
            return decode.get(self.threads)
        return decode[min(decode, key=lambda threads: abs(threads - self.threads))]

    @property
    def seconds_per_prefill_token(self) -> float | None:
        costs = self._beside or self._alone
        if self.threads in costs or not costs:
            return costs.get(self.threads)
        nearest = min(costs, key=lambda threads: abs(threads - self.threads))
        return costs[nearest] * nearest / self.threads

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """One step's wall time, with the tokens it computed, on `threads` threads."""
        if num_prefill_tokens == 0:
            if num_decode_tokens > 0:
                self._average(self._decode, seconds)
            return
        if num_decode_tokens == 0:
            self._average(self._alone, seconds / num_prefill_tokens)
            return
        # The decodes' share: what a step of decodes alone costs (nothing until measured).
        prefill_seconds = max(seconds - (self.decode_seconds or 0.0), 0.0)
        self._average(self._beside, prefill_seconds / num_prefill_tokens)

    def prefill_tokens_within(self, seconds: float) -> int | None:
        """Prefill tokens that fit beside a step's decodes in a step of `seconds`; None until
        a step with prefill tokens was measured."""
        per_token = self.seconds_per_prefill_token
        if per_token is None:
            return None
        left = seconds - (self.decode_seconds or 0.0)
        if per_token <= 0.0:
            return None  # too fast to measure: the token budget decides
        return max(int(left / per_token), 0)


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_seconds: float | None = None,
        step_time: StepTimeModel | None = None,
        min_prefill_tokens: int = 16,
        max_overtakes: int = 8,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if step_seconds is not None and step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
        if min_prefill_tokens < 1:
            raise ValueError(f"min_prefill_tokens must be >= 1, got {min_prefill_tokens}")
        if max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0, got {max_overtakes}")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The time budget of a step that carries decodes (None: the token budget alone).
        self.step_seconds = step_seconds
        self.step_time = step_time if step_time is not None else StepTimeModel()
        self.min_prefill_tokens = min_prefill_tokens
        self.max_overtakes = max_overtakes  # interactive requests that may overtake a batch one
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrival: dict[str, int] = {}  # request id -> arrival order (running order, preemption)
        self._next_arrival = 0
        self.num_preemptions = 0
        # Called with a request whose blocks were just freed (finished, aborted, preempted):
        # a draft-model proposer frees its own KV blocks too (engine.native.core.spec_decode).
        self.release_hooks: list[Callable[[Request], None]] = []
        # Called with an admitted request that has a document plan and its block table.
        # It returns the positions left to compute (ascending, the last prompt token last).
        self.assemble: Callable[[Request, list[int]], list[int]] | None = None

    # ------------------------------------------------------------------ queue

    def add(self, request: Request) -> None:
        if request.request_id in self._arrival:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1
        if request.priority <= PRIORITY_INTERACTIVE:
            # Ahead of the batch requests at the queue's tail that may still be overtaken (they
            # are always a tail: they keep their order, and the oldest of them ages first).
            position = len(self.waiting)
            while position > 0 and self._overtakable(self.waiting[position - 1]):
                position -= 1
                self.waiting[position].num_overtaken += 1
            self.waiting.insert(position, request)
        else:
            self.waiting.append(request)

    def _overtakable(self, request: Request) -> bool:
        return (
            request.priority > PRIORITY_INTERACTIVE
            and request.num_preemptions == 0  # a preempted request keeps the front
            and request.num_overtaken < self.max_overtakes
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Request | None:
        for request in self.running:
            if request.request_id == request_id:
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                return request
        return None

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of the engine and give its blocks back, at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.manager.free(request.request_id)
        self._arrival.pop(request.request_id, None)
        for hook in self.release_hooks:
            hook(request)

    # ------------------------------------------------------------------ steps

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.manager.free(request.request_id)
        for hook in self.release_hooks:
            hook(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        arrival = self._arrival
        scheduled: dict[str, ScheduledChunk] = {}
        preempted: list[str] = []

        by_arrival = sorted(self.running, key=lambda r: arrival[r.request_id])
        decodes = [r for r in by_arrival if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in by_arrival if r.num_tokens - r.num_computed_tokens > 1]
        decode_ids = {r.request_id for r in decodes}
        # Prefill tokens the step's time budget leaves beside its decodes (None: no limit),
        # set once the decodes are scheduled.
        prefill_left: int | None = None
        limited = False
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            is_decode = request.request_id in decode_ids
            if not is_decode and not limited:
                prefill_left, limited = self._prefill_limit(scheduled), True
            if not is_decode and prefill_left == 0:
                break  # only prefills are left, and the time budget is spent
            cap = budget if is_decode or prefill_left is None else min(budget, prefill_left)
            num_new = min(request.num_tokens - request.num_computed_tokens, cap)
            # A decode's drafts ride along while budget and pool allow; they never preempt.
            drafts = request.spec_token_ids[: budget - num_new] if is_decode else []
            if (
                drafts
                and self.manager.allocate_slots(request.request_id, request.num_tokens + len(drafts)) is None
            ):
                drafts = []
            total = request.num_computed_tokens + num_new
            while self.manager.allocate_slots(request.request_id, total) is None:
                victim = max(self.running, key=lambda r: arrival[r.request_id])
                self._preempt(victim)
                preempted.append(victim.request_id)
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_tokens
                    if prefill_left is not None and victim.request_id not in decode_ids:
                        prefill_left += undone.num_tokens
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled[request.request_id] = self._chunk(request, num_new + len(drafts), drafts)
            budget -= num_new + len(drafts)
            if not is_decode and prefill_left is not None:
                prefill_left -= num_new
        if not limited:
            prefill_left = self._prefill_limit(scheduled)

        while (
            not preempted
            and self.waiting
            and budget > 0
            and (prefill_left is None or prefill_left > 0)
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            if request.blockers:
                break  # its documents are being prefilled ahead of it
            record = request.num_preemptions == 0 and not request.prefill_only
            computed_blocks, num_cached = self.manager.get_computed_blocks(
                request.all_token_ids, request.cache_salt, record_stats=record
            )
            if request.document_plan is not None:
                # Assembled KV, tagged from the first block past the plain hit; a request
                # assembled alike before left its blocks there.
                tag = request.document_plan.variant_tag
                request.cache_variant = (num_cached // self.manager.block_size, tag)
                computed_blocks, num_cached = self.manager.get_computed_blocks(
                    request.all_token_ids,
                    request.cache_salt,
                    record_stats=record,
                    variant=request.cache_variant,
                )
            assemble = self.assemble if request.document_plan is not None else None
            # An assembled prompt's fresh positions are one scattered chunk: never cut.
            cap = budget if prefill_left is None else min(budget, prefill_left)
            num_new = (
                request.num_tokens - num_cached if assemble else min(request.num_tokens - num_cached, cap)
            )
            if self.manager.allocate_slots(request.request_id, num_cached + num_new, computed_blocks) is None:
                break  # nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            self.running.append(request)
            if assemble is not None:
                table = self.manager.block_table(request.request_id)
                positions = assemble(request, table)
                num_new = len(positions)
                scattered = tuple(positions) if num_new > 1 else ()
                scheduled[request.request_id] = ScheduledChunk(
                    request, positions[0], num_new, tuple(table), positions=scattered
                )
            else:
                scheduled[request.request_id] = self._chunk(request, num_new)
            budget -= num_new
            if prefill_left is not None:
                prefill_left = max(prefill_left - num_new, 0)

        chunks = sorted(scheduled.values(), key=lambda c: arrival[c.request.request_id])
        return SchedulerOutput(
            decodes=tuple(c for c in chunks if c.num_tokens == 1),
            prefills=tuple(c for c in chunks if c.num_tokens > 1),
            preempted=tuple(preempted),
        )

    def _prefill_limit(self, scheduled: Mapping[str, ScheduledChunk]) -> int | None:
        """Prefill tokens that fit beside the decodes `scheduled` in the step's time budget:
        at least `min_prefill_tokens`; None (the token budget alone) in a step without decodes,
        without a time budget, or before the step time is measured."""
        if self.step_seconds is None or not scheduled:
            return None
        fit = self.step_time.prefill_tokens_within(self.step_seconds)
        return None if fit is None else max(fit, self.min_prefill_tokens)

    def _chunk(
        self, request: Request, num_new: int, drafts: list[int] | tuple[int, ...] = ()
    ) -> ScheduledChunk:
        return ScheduledChunk(
            request=request,
            start=request.num_computed_tokens,
            num_tokens=num_new,
            block_table=self.manager.block_ids(request.request_id),
            draft_token_ids=tuple(drafts),
        )

    def update_computed(self, output: SchedulerOutput) -> None:
        """After the model ran the step: the chunks' KV is written; cache the full blocks."""
        for chunk in output.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue
            # Drafts' KV is written but uncommitted until `update_from_output` has the verdict.
            request.num_computed_tokens = chunk.context_len - len(chunk.draft_token_ids)
            self.manager.cache_blocks(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                request.cache_salt,
                request.cache_variant,
            )

    def update_from_output(self, output: SchedulerOutput, new_token_ids: Mapping[str, Sequence[int]]) -> None:
        """After the step's tokens were appended to their requests (`new_token_ids`: request id
        -> the tokens this step sampled or verified): commit the accepted drafts.

        A decode with k drafts queried positions start .. start + k; `update_computed` counted
        only position `start`. With n tokens appended (n - 1 accepted drafts, then the recovered
        or bonus token), positions start .. start + n - 1 hold KV of committed tokens, so
        `num_computed_tokens` becomes start + n, one short of `num_tokens` (the last token is
        the next step's decode). Blocks that held only rejected drafts go back to the pool.
        Requests that finished this step already gave all their blocks back.
        """
        for chunk in output.chunks:
            request = chunk.request
            request.spec_token_ids = []  # drafts are proposed afresh for every step
            if not chunk.draft_token_ids or request.status is not RequestStatus.RUNNING:
                continue
            num_accepted = len(new_token_ids[request.request_id]) - 1
            request.num_computed_tokens += num_accepted
            self.manager.commit_speculative(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                request.cache_salt,
                request.cache_variant,
            )
