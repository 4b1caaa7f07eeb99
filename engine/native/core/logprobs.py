"""Logprobs of the sampled tokens, for the requests that ask (`SamplingParams.logprobs`).

Which distribution: the model's raw one, log_softmax of the logits as the model produced them,
before temperature, top-k, top-p and min-p. That is vLLM's default (`logprobs_mode=
"raw_logprobs"`) and what the OpenAI API reports: the numbers do not depend on the sampling
parameters, and a token the filters could never have drawn still gets its finite logprob. Under
greedy decoding the sampled token is therefore the most likely alternative (ties aside).

Cost: the caller passes only the rows of requests that asked, so a batch where nobody asked
computes nothing; the rest cost one log_softmax over those rows and one top-k. Sampling reads
the same logits but never writes them, so asking for logprobs changes no sampled token.
"""

from __future__ import annotations

import torch

from ragspeed.engine.protocol import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, rows: list[int], token_ids: list[int], num_top: list[int]
) -> list[TokenLogprob]:
    """logits [num_rows, vocab]; for each i, token `token_ids[i]` was sampled from row
    `rows[i]` and `num_top[i]` alternatives are wanted -> one TokenLogprob per i."""
    if not rows:
        return []
    device = logits.device
    picked = (
        logits
        if len(rows) == logits.shape[0] and rows == list(range(len(rows)))
        else (logits[torch.tensor(rows, device=device)])
    )
    logprobs = picked.float().log_softmax(dim=-1)  # [n, vocab]
    ids = torch.tensor(token_ids, dtype=torch.long, device=device).unsqueeze(1)  # [n, 1]
    sampled = logprobs.gather(1, ids).squeeze(1).tolist()  # [n]
    max_top = max(num_top)
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    if max_top:
        values, indices = logprobs.topk(max_top, dim=-1)  # [n, max_top], most likely first
        top_ids, top_values = indices.tolist(), values.tolist()
    return [
        TokenLogprob(
            token_id=token,
            logprob=logprob,
            top=tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else (),
        )
        for i, (token, logprob, k) in enumerate(zip(token_ids, sampled, num_top))
    ]
