"""A request inside the native engine, from admission to finish.

Terms: `all_token_ids` is prompt + output so far; `num_computed_tokens` counts the leading
tokens whose KV is in the request's blocks. A request *needs a prefill* while
`num_computed_tokens < num_tokens - 1` (more than the one new token of a decode is missing);
the step that computes its last missing token samples the next token. After preemption by
recompute, the output so far becomes part of what is prefilled again.

Document KV reuse (engine.native.core.document_kv) adds: `document_plan` (engine.native.core.document_plan: the request's
documents and their stored KV), `blockers` (keys of the document prefills it waits on: the scheduler admits it only
once none is left), `cache_variant` (set at admission: its blocks from the first one it computes
on hold assembled KV, and enter the prefix cache tagged, found only by requests assembled
alike: prompt_cache.hashing) and, on a document prefill, `document_key` and `document_start` (where its
document begins).
"""

from __future__ import annotations

import enum

from ragspeed.engine.native.core.detokenizer import IncrementalDetokenizer
from ragspeed.engine.native.core.document_plan import DocumentPlan
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.native.core.stop import StopStringMatcher
from ragspeed.engine.protocol import GenerationRequest
from ragspeed.prompt_cache.hashing import Variant


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request: GenerationRequest,
        sampling: SamplingState,
        *,
        detokenizer: IncrementalDetokenizer | None,
        prefill_only: bool = False,
        pin: bool = False,
    ):
        self.request_id = request.request_id
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.all_token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.cache_salt = request.cache_salt
        # Waiting-queue order (engine.native.core.scheduler): PRIORITY_INTERACTIVE before PRIORITY_BATCH;
        # `num_overtaken` counts the interactive entries queued ahead of a waiting batch request.
        self.priority = request.priority
        self.num_overtaken = 0
        self.sampling = sampling
        self.prefill_only = prefill_only  # warm(): fill the prefix cache, sample nothing
        self.pin = pin  # a prefill-only request that pins its full blocks as it finishes
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until then
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.stop_matcher = StopStringMatcher(sampling.params.stop)
        self.first_delta_sent = False
        # Draft tokens proposed for this step (engine.native.core.spec_decode); never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        self.document_plan: DocumentPlan | None = None
        self.blockers: set[str] = set()
        self.cache_variant: Variant | None = None
        self.document_key: str | None = None
        self.document_start = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
