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

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ragspeed.engine.native.compute.attention_metadata import SMALL_CHUNK_QUERIES
from ragspeed.engine.native.compute.cpu_kernels import decode_step

# A step of at most this many tokens runs its small ops on one thread.
SMALL_STEP_TOKENS = 16


def forward_threads(num_tokens: int, num_threads: int, device: torch.device) -> int:
    """Torch threads for a forward pass of `num_tokens` tokens (the model runner's and the
    draft proposer's): one for a small step on a CPU, else `num_threads`."""
    small = device.type == "cpu" and num_tokens <= SMALL_STEP_TOKENS
    return 1 if small else num_threads


@contextmanager
def forward_pass(
    chunk_sizes: list[int], num_threads: int, device: torch.device, decode_kernels: bool | None = None
) -> Iterator[None]:
    """One forward pass over chunks of `chunk_sizes` tokens (the model runner's and the draft
    proposer's): its thread count (`forward_threads`) and, when every chunk is small
    (decodes, verifications), the row-invariant CPU kernels (engine.native.compute.cpu_kernels.decode_step);
    `decode_kernels` True or False chooses those kernels whatever the sizes (a quality
    window measures one kind of product)."""
    if decode_kernels is None:
        decode_kernels = max(chunk_sizes, default=0) <= SMALL_CHUNK_QUERIES
    with cpu_threads(forward_threads(sum(chunk_sizes), num_threads, device)):
        with decode_step(decode_kernels):
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


class DecodeThreads:
    """The thread count of a step of decodes, chosen by measurement, per batch size (buckets
    of powers of two): the engine's count or one fewer, whichever has been the faster lately.

    Why measure: a decode step is a few hundred barriers of its threads, and every token also
    wakes the server's event loop (and its client). On two cores, the thread that wakes then
    deschedules one of the step's threads and the others wait at the next barrier. Which wins
    depends on the batch, the machine and what else runs on it (another process, or a second
    OpenMP team in this one: engine.backends.native.NativeEngine._build_and_run), so it is
    timed: each count is tried `WARMUP` times per bucket, then the faster is used, and the
    slower is timed again once every `explore_s` seconds in its bucket, so that a change of
    load is followed."""

    WARMUP = 4
    _WEIGHT = 0.3  # of each new time in a count's running mean

    def __init__(self, explore_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.explore_s = explore_s
        self.clock = clock
        self._mean: dict[tuple[int, int], float] = {}  # (bucket, threads) -> seconds a step
        self._count: dict[tuple[int, int], int] = {}
        self._explored: dict[int, float] = {}  # bucket -> when the slower count was last timed

    def pick(self, batch: int, num_threads: int) -> int:
        """Threads for a step of `batch` decodes when `num_threads` are the engine's."""
        if num_threads < 2:
            return num_threads
        bucket = batch.bit_length()
        candidates = (num_threads, num_threads - 1)
        for threads in candidates:
            if self._count.get((bucket, threads), 0) < self.WARMUP:
                self._explored[bucket] = self.clock()
                return threads
        best, slower = sorted(candidates, key=lambda threads: self._mean[bucket, threads])
        now = self.clock()
        if now - self._explored[bucket] >= self.explore_s:
            self._explored[bucket] = now
            return slower
        return best

    def observe(self, batch: int, threads: int, seconds: float) -> None:
        key = (batch.bit_length(), threads)
        count = self._count.get(key, 0)
        mean = self._mean.get(key, seconds)
        self._mean[key] = seconds if count == 0 else mean + self._WEIGHT * (seconds - mean)
        self._count[key] = count + 1
