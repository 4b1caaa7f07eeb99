"""Random prompts of token ids for the benches that run a model (bench.common stays free of
torch: the prompt-cache bench imports it)."""

from __future__ import annotations

import torch


def random_prompt(generator: torch.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    """`length` token ids drawn with `generator`, from 2 on: 0/1 are special tokens in the bench
    models' tokenizers."""
    return tuple(torch.randint(2, vocab_size, (length,), generator=generator).tolist())
