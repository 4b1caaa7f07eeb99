"""ragspeed's own CPU kernels: products of a few rows with a weight stored in column blocks,
decode attention over the paged pool, the residual add with RMSNorm, and the whole decoder of a
decode-type step in one call, and prefill products on a GGUF file's 4-bit blocks with integer
multiply-adds (int8_prefill).

The C sources (`build.SOURCES`) are compiled on first use with the machine's C compiler for the
machine's own CPU (`-march=native`) and kept in a cache; `build.load_library` returns None where
that is not possible, and the model then runs layer by layer on oneDNN / fbgemm / SDPA alone.
`BlockedWeight` holds one weight in the kernel's layout and runs the product; `decoder.py` runs
a model's decode steps (and a draft's greedy steps) in one call each.
"""

from ragspeed.engine.native.compute.cpu_kernels.blocked import (
    BlockedWeight,
    blocked_kernels_available,
    decode_step,
    takes_blocked,
)
from ragspeed.engine.native.compute.cpu_kernels.build import load_library

__all__ = [
    "BlockedWeight",
    "blocked_kernels_available",
    "decode_step",
    "load_library",
    "takes_blocked",
]
