"""The environment variables beneath the serving options, read in one place.

The gateway's `Settings` read the serving options (`RAGSPEED_PORT`, ...). The process-wide
folders and switches every command shares are read here, once, by `configure()`; the modules
that use them take them from `current()` and read no environment themselves:

- `RAGSPEED_CACHE_DIR`: the model cache (engine.native.loading.model_zoo; default ~/.cache/ragspeed/models) and
  the folder of the distilled static encoder (compression.scoring.static_encoder; default
  ~/.cache/ragspeed).
- `RAGSPEED_KERNEL_CACHE`: where the CPU kernels are compiled to (engine.native.compute.cpu_kernels.build;
  default ~/.cache/ragspeed/kernels), with the prefill paths' times measured on this machine
  (engine.native.compute.quant.probe).
- `RAGSPEED_CPU_KERNELS=0`: no CPU kernels (oneDNN / fbgemm for every product).
- `RAGSPEED_CPU_ISA`: the instruction sets the engine may use, `native` (the default: all this
  CPU has), `avx2` (as an AVX2-only CPU: no AVX-512, no VNNI, no BF16) or `plain` (no AVX): the
  kernels are built for it and the paths chosen by CPU features see only its flags, so a
  machine with AVX-512 runs the code of a narrower one (with `ATEN_CPU_CAPABILITY=avx2` and
  `ONEDNN_MAX_CPU_ISA=AVX2`, torch's own kernels too).
- `CC`: the compiler of the CPU kernels (default `cc`, else `gcc`).

The `ragspeed` command calls `configure()` at start-up; without it, the first `current()` reads
the process's environment. A program may hand values of its own with
`configure(Environment(...))` before building the engine or the compressors. The CPU kernels
are built on first use with the values of that moment, and kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = "RAGSPEED_CACHE_DIR"
KERNEL_CACHE = "RAGSPEED_KERNEL_CACHE"
CPU_KERNELS = "RAGSPEED_CPU_KERNELS"
COMPILER = "CC"
CPU_ISA = "RAGSPEED_CPU_ISA"
CPU_ISAS = ("native", "avx2", "plain")


@dataclass(frozen=True)
class Environment:
    cache_dir: Path | None = None  # None: each user's default folder
    kernel_cache: Path | None = None
    cpu_kernels: bool = True
    compiler: str = "cc"
    cpu_isa: str = "native"  # one of CPU_ISAS

    def __post_init__(self) -> None:
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"{CPU_ISA} must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")


def _folder(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def read_environment(environ: Mapping[str, str] = os.environ) -> Environment:
    """The values `environ` sets; the defaults for those it does not."""
    return Environment(
        cache_dir=_folder(environ.get(CACHE_DIR)),
        kernel_cache=_folder(environ.get(KERNEL_CACHE)),
        cpu_kernels=environ.get(CPU_KERNELS, "1") != "0",
        compiler=environ.get(COMPILER) or "cc",
        cpu_isa=environ.get(CPU_ISA) or "native",
    )


_current: Environment | None = None


def current() -> Environment:
    """What `configure` handed down last (the process's environment before it ran)."""
    return _current if _current is not None else configure()


def configure(environment: Environment | None = None) -> Environment:
    """Make `environment` (default: the process's, read now) what `current()` gives."""
    global _current
    _current = environment if environment is not None else read_environment()
    return _current
