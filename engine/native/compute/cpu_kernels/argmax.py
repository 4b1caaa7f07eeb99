"""The greedy token of each row of logits in one call of the kernels (rowwise.c).

torch's argmax over a vocabulary of 49,152 fp32 logits takes about 45 us a row on a CPU;
the kernel keeps a running maximum per vector lane and takes a few.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ragspeed.engine.native.compute.cpu_kernels.build import load_library
from ragspeed.engine.native.compute.step_buffers import RowBuffer


def _kernel_takes(logits: torch.Tensor) -> bool:
    """Whether the kernel can read these logits ([rows, vocab] fp32 CPU, rows contiguous)."""
    return (
        load_library() is not None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(-1) == 1
    )


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> list[int]:
    """logits [rows, vocab] -> each row's index of its largest value (the first of equals, as
    torch.argmax). `out`: a CPU int64 buffer [rows] the kernel writes them into (the caller's,
    kept across steps), else a fresh one."""
    if not _kernel_takes(logits):
        return logits.argmax(dim=-1).tolist()
    library = load_library()
    assert library is not None  # _kernel_takes checked it
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.long)
    assert out.dtype == torch.long and out.shape == (rows,)
    library.ragspeed_argmax(logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr())
    return out.tolist()


class GreedyArgmax:
    """`argmax` into an int64 buffer kept across calls. A call on the same logits tensor as the
    call before (a step buffer's view: the same object for the same row count) reuses that
    call's checks and pointers: after a decode step's weights streamed through the caches,
    each torch query of a tensor's shape, dtype or memory costs tens of microseconds."""

    def __init__(self) -> None:
        self._tokens = RowBuffer((), torch.long)
        self._logits: torch.Tensor | None = None  # the last call's, where the kernel took it
        self._call: tuple = ()  # its kernel arguments
        self._kernel: Callable[..., None] | None = None  # set with `_logits`

    def __call__(self, logits: torch.Tensor) -> list[int]:
        if logits is self._logits:
            words = self._tokens.words
            assert self._kernel is not None and words is not None
            self._kernel(*self._call)
            return words[: self._call[1]]
        self._logits = None
        rows = logits.shape[0]
        self._tokens.reserve(rows)
        out = self._tokens.rows(rows)
        tokens = argmax(logits, out)
        if _kernel_takes(logits):
            library = load_library()
            assert library is not None  # _kernel_takes checked it
            self._logits, self._kernel = logits, library.ragspeed_argmax
            self._call = (logits.data_ptr(), rows, logits.shape[1], logits.stride(0), out.data_ptr())
        return tokens
