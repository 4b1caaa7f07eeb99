"""Verify draft tokens against the target's logits without changing the output distribution.

Greedy: accept drafts while each equals the target's argmax at its position; then append the
target's argmax at the first disagreement (recovered) or after the last draft (bonus). The
output is exactly what decoding without speculation gives.

Sampling (Leviathan et al. 2023, Chen et al. 2023). Let p be the target's distribution at a
position (after temperature, top-k, min-p, top-p: the same `p` the plain sampler draws from)
and q the proposer's. Accepting draft x with probability min(1, p(x) / q(x)) and, on rejection,
drawing from norm(max(0, p - q)) yields a token distributed exactly as p:
  P(out = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(q(z), p(z))) * max(0, p(y) - q(y)) / Z
             = min(q(y), p(y)) + max(0, p(y) - q(y)) = p(y),   Z = sum_z max(0, p(z) - q(z)).
A prompt-lookup proposer is deterministic: q is a point mass on x. Then min(1, p(x)/q(x)) =
p(x), and max(0, p - q) is p with x removed (p(x) - 1 <= 0), renormalised: "accept x with
probability p(x), else draw from p without x". After the k-th accepted draft the bonus token
is a plain draw from p at position k + 1. Each position's decision is conditioned on the
accepted prefix, so the whole appended sequence follows the target's joint distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragspeed.engine.native.compute.cpu_kernels.argmax import argmax
from ragspeed.engine.native.core.sampler import _filter_top_k, _filter_top_p
from ragspeed.engine.native.core.sampling import SamplingState


def verify_greedy(logits: torch.Tensor, draft_token_ids: Sequence[int]) -> list[int]:
    """logits [1 + k, vocab] at the last token and each draft -> tokens to append
    (accepted drafts, then one recovered or bonus token)."""
    target = argmax(logits)  # [1 + k]
    out: list[int] = []
    for draft, best in zip(draft_token_ids, target):
        if draft != best:
            break
        out.append(draft)
    out.append(target[len(out)])
    return out


def target_probs(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """logits [n, vocab] of one request -> the distribution its sampler draws from, [n, vocab]."""
    params = state.params
    n, vocab = logits.shape
    scaled = logits / params.temperature
    if 0 < params.top_k < vocab:
        scaled = _filter_top_k(scaled, torch.full((n,), params.top_k, device=logits.device))
    probs = scaled.softmax(dim=-1)
    if params.min_p > 0.0:
        threshold = probs.amax(dim=-1, keepdim=True) * params.min_p
        probs = probs.masked_fill(probs < threshold, 0.0)
    if params.top_p < 1.0:
        probs = _filter_top_p(probs, torch.full((n,), params.top_p, device=logits.device))
    return probs / probs.sum(dim=-1, keepdim=True)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [vocab] (unnormalised is fine): the exponential race."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race).argmax())


def verify_sampled(
    logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    state: SamplingState,
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling with a point-mass proposal (see the module docstring).
    logits [1 + k, vocab] -> accepted drafts, then one recovered or bonus token."""
    probs = target_probs(logits, state)  # [1 + k, vocab]
    k = len(draft_token_ids)
    drafts = torch.tensor(list(draft_token_ids), dtype=torch.long, device=logits.device)
    p_draft = probs[torch.arange(k, device=logits.device), drafts].tolist()  # p_i(x_i), [k]
    uniforms = torch.rand(k, generator=generator, device=logits.device).tolist()
    out: list[int] = []
    for i, (x, p_x, u) in enumerate(zip(draft_token_ids, p_draft, uniforms)):
        if u < p_x:  # accept with probability min(1, p(x) / 1)
            out.append(x)
            continue
        residual = probs[i].clone()
        residual[x] = 0.0  # max(0, p - q) for q = one-hot(x); _draw needs no renormalising
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[k], generator))  # every draft accepted: the bonus token
    return out


def verify_sampled_q(
    logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor,
    state: SamplingState,
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling with a general proposal: draft_probs [k, vocab] is q at each draft
    (zero outside a sub-vocabulary head's ids, mapped to target ids), the drafts drawn from it.
    Accept x with probability min(1, p(x) / q(x)), else draw from max(0, p - q) (the module
    docstring); `verify_sampled` is the point-mass case. No engine proposer samples its drafts
    today: they are greedy."""
    probs = target_probs(logits, state)  # [1 + k, vocab]
    uniforms = torch.rand(len(draft_token_ids), generator=generator, device=logits.device).tolist()
    out: list[int] = []
    for i, (x, u) in enumerate(zip(draft_token_ids, uniforms)):
        p_x, q_x = float(probs[i, x]), float(draft_probs[i, x])
        if u * q_x < p_x:  # u < p(x) / q(x), without dividing by q(x) (q(x) > 0: x was drawn)
            out.append(x)
            continue
        out.append(_draw((probs[i] - draft_probs[i]).clamp(min=0.0), generator))
        return out
    out.append(_draw(probs[len(draft_token_ids)], generator))
    return out
