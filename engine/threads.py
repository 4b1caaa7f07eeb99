"""CPU threads of the forward pass: how many, and which ops get them.

A step of a few tokens (decodes, speculative verification) is bound by reading the weights:
its linear layers want every core, while its other ~20 ops per layer are so small that
splitting them across threads costs more in fork and join than it saves (on two cores, the
context gather and attention of a batch-1 decode run slower on two threads than on one). So
the model runner runs small steps on one thread
and the linear kinds switch to the engine's count around their product (`linear_threads`);
prefill chunks run everything on all threads. Switching costs about 0.2 us.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ragspeed.engine.attention import SMALL_CHUNK_QUERIES
from ragspeed.engine.cpu_kernels import decode_step

# A step of at most this many tokens runs its small ops on one thread.
SMALL_STEP_TOKENS = 16


def forward_threads(num_tokens: int, num_threads: int, device: torch.device) -> int:
    """Torch threads for a forward pass of `num_tokens` tokens (the model runner's and the
    draft proposer's): one for a small step on a CPU, else `num_threads`."""
    small = device.type == "cpu" and num_tokens <= SMALL_STEP_TOKENS
    return 1 if small else num_threads


@contextmanager
def forward_pass(chunk_sizes: list[int], num_threads: int, device: torch.device) -> Iterator[None]:
    """One forward pass over chunks of `chunk_sizes` tokens (the model runner's and the draft
    proposer's): its thread count (`forward_threads`) and, when every chunk is small
    (decodes, verifications), the row-invariant CPU kernels (engine.cpu_kernels.decode_step)."""
    small_chunks = max(chunk_sizes, default=0) <= SMALL_CHUNK_QUERIES
    with cpu_threads(forward_threads(sum(chunk_sizes), num_threads, device)):
        with decode_step(small_chunks):
            yield


@contextmanager
def cpu_threads(num_threads: int) -> Iterator[None]:
    """Run the block on `num_threads` torch threads, then restore the previous count."""
    previous = torch.get_num_threads()
    if num_threads == previous:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def linear_threads(num_threads: int, fn, *args):
    """`fn(*args)` on `num_threads` threads (a linear layer's product); the hot path's version
    of `cpu_threads`, without a context manager's overhead."""
    previous = torch.get_num_threads()
    if previous == num_threads:
        return fn(*args)
    torch.set_num_threads(num_threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(previous)
