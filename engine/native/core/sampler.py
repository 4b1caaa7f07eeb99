"""Turn last-token logits into next tokens: greedy, temperature, top-k, top-p, min-p, seeds.

Rows of requests with a logits processor (penalties, logit_bias, a grammar's mask:
engine.native.core.logits_process) are copied and processed first; the other rows are sampled as they are.

The filters run batched over the rows that sample; only the final draw is per row, because a
request with a seed draws from its own `torch.Generator` (so its output does not depend on what
else is in the batch). The draw is the exponential race `argmax(p / E)`, `E ~ Exp(1)`, which
picks token i with probability p_i, as `torch.multinomial` would, without a sort.
"""

from __future__ import annotations

import torch

from ragspeed.engine.native.compute.cpu_kernels.argmax import GreedyArgmax
from ragspeed.engine.native.core.sampling import SamplingState


def _filter_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab]; top_k [n] (vocab size where disabled). Masks all below the k-th."""
    max_k = int(top_k.max())
    kth = logits.topk(max_k, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))  # [n, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly likelier tokens
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0):
        # Requests without a seed draw from the engine's generator (seeded by EngineConfig.seed).
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._argmax = GreedyArgmax()

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        """logits [num_requests, vocab] fp32 -> one token id per request; `logits` is not
        changed."""
        processed = [i for i, s in enumerate(states) if s.processor is not None]
        if not processed:
            return self._draw(logits, states)
        tokens = [0] * len(states)
        host = logits.detach().cpu().numpy()  # no copy on a CPU
        free = [i for i, s in enumerate(states) if s.processor is None]
        if free:
            free_rows = torch.from_numpy(host[free]).to(logits.device)
            for i, token in zip(free, self._draw(free_rows, [states[i] for i in free])):
                tokens[i] = token
        # A copy [num_processed, vocab], processed in numpy (engine.native.core.logits_process says why).
        rows = host[processed]
        for row, i in enumerate(processed):
            processor = states[i].processor
            assert processor is not None
            processor(rows[row])
        for i, token in zip(
            processed, self._draw(torch.from_numpy(rows).to(logits.device), [states[i] for i in processed])
        ):
            tokens[i] = token
        return tokens

    def _draw(self, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
        greedy = [s.params.greedy for s in states]
        if any(greedy):
            tokens = self._argmax(logits)
            if all(greedy):
                return tokens
        else:
            tokens = [0] * len(states)
        rows = [i for i, g in enumerate(greedy) if not g]
        sub_states = [states[i] for i in rows]
        device = logits.device
        sub = logits[rows] if len(rows) < len(states) else logits
        temperature = torch.tensor([s.params.temperature for s in sub_states], device=device)
        sub = sub / temperature.unsqueeze(1)
        vocab = sub.shape[1]
        top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in sub_states]
        if min(top_k) < vocab:
            sub = _filter_top_k(sub, torch.tensor(top_k, device=device))
        probs = sub.softmax(dim=-1)
        min_p = [s.params.min_p for s in sub_states]
        if max(min_p) > 0.0:
            min_p_t = torch.tensor(min_p, device=device).unsqueeze(1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p_t
            probs = probs.masked_fill(probs < threshold, 0.0)
        top_p = [s.params.top_p for s in sub_states]
        if min(top_p) < 1.0:
            probs = _filter_top_p(probs, torch.tensor(top_p, device=device))
        for row, (i, state) in enumerate(zip(rows, sub_states)):
            generator = state.generator or self.generator
            race = torch.empty_like(probs[row]).exponential_(generator=generator)
            tokens[i] = int((probs[row] / race).argmax())
        return tokens
