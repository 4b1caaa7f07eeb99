"""What changes one request's logits before its token is drawn: OpenAI's frequency and presence
penalties, vLLM's repetition penalty, `logit_bias` and a grammar's mask (engine.native.core.structured).

Only requests whose `SamplingParams.processes_logits` is true get a processor; the sampler runs
it on a copy of their rows, so a free request in the same batch pays nothing and the raw
logprobs (engine.protocol) stay those of the unprocessed logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from ragspeed.engine.native.core.structured import GrammarMatcher
from ragspeed.engine.protocol import SamplingParams


class LogitsProcessor:
    """The processing of one request, kept up to date with its output (`accept`). It runs in
    numpy: between the fused decoder's calls no torch op runs, and a torch op there wakes torch's
    thread pool beside the kernels' own (a batch-1 step took 4x as long)."""

    def __init__(
        self, params: SamplingParams, prompt_token_ids: Sequence[int], matcher: GrammarMatcher | None
    ):
        self.params = params
        self.matcher = matcher
        self._output_counts: Counter[int] = Counter()
        # The repetition penalty looks at the prompt too (vLLM's definition).
        self._seen = set(prompt_token_ids) if params.repetition_penalty != 1.0 else set()
        self._bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)

    def __call__(self, logits: np.ndarray) -> None:
        """Process one row of logits [vocab] (float32), in place."""
        params = self.params
        if params.repetition_penalty != 1.0 and self._seen:
            ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            values = logits[ids]
            penalty = params.repetition_penalty
            logits[ids] = np.where(values > 0, values / penalty, values * penalty)
        if (params.frequency_penalty or params.presence_penalty) and self._output_counts:
            ids = np.fromiter(self._output_counts.keys(), dtype=np.int64, count=len(self._output_counts))
            counts = np.fromiter(self._output_counts.values(), dtype=np.float32, count=len(ids))
            logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
        if params.logit_bias:
            logits[self._bias_ids] += self._bias
        if self.matcher is not None:
            self.matcher.mask_logits(logits)  # last: a bias cannot lift a forbidden token

    def accept(self, token_id: int) -> None:
        """The request's next output token."""
        self._output_counts[token_id] += 1
        if self.params.repetition_penalty != 1.0:
            self._seen.add(token_id)
        if self.matcher is not None:
            self.matcher.accept(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar accepts the output and allows nothing more: the request is done."""
        return self.matcher is not None and self.matcher.is_stopped
