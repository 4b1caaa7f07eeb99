"""Compile kernels.c once per machine and load it with ctypes.

The library goes to `~/.cache/ragspeed/kernels/kernels-<hash>.so` (or `$RAGSPEED_KERNEL_CACHE`),
the hash covering the source, the compiler command and the CPU's model and flags, so a changed
source or another machine builds its own. It is compiled to a temporary name and renamed, so
processes starting at once never load half a file. It links the OpenMP runtime torch already
loaded (libgomp): the kernels share torch's threads instead of bringing their own.

`RAGSPEED_CPU_KERNELS=0` turns the kernels off (oneDNN / fbgemm for every product).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

# Package data; a file on disk in every install (the compiler is given its path).
SOURCE = Path(str(resources.files("ragspeed.engine.cpu_kernels") / "kernels.c"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-lm")
ENABLE_ENV = "RAGSPEED_CPU_KERNELS"
CACHE_ENV = "RAGSPEED_KERNEL_CACHE"


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ragspeed" / "kernels"


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        staged = Path(staging) / target.name
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(staged)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(staged, target)


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    library.ragspeed_gemv_f32.argtypes = [pointer] * 4 + [integer] * 4
    library.ragspeed_gemv_i8.argtypes = [pointer] * 5 + [integer] * 4
    library.ragspeed_gemv_q4.argtypes = [pointer] * 5 + [integer] * 4
    library.ragspeed_paged_decode_attention.argtypes = (
        [pointer] * 6 + [integer] * 6 + [ctypes.c_float, integer, integer]
    )
    library.ragspeed_add_rms_norm.argtypes = [pointer] * 4 + [integer] * 2 + [ctypes.c_float, integer]
    library.ragspeed_decode_forward.argtypes = [pointer] * 11 + [integer] * 5
    library.ragspeed_argmax.argtypes = [pointer] + [integer] * 3 + [pointer]
    library.ragspeed_place_kv.argtypes = [pointer] * 4 + [integer] * 4 + [ctypes.c_int64, integer, integer]
    library.ragspeed_to_f16.argtypes = [pointer, pointer, integer]
    library.ragspeed_int8_group.argtypes = []
    library.ragspeed_int8_group.restype = integer
    library.ragspeed_greedy_steps.argtypes = (
        [pointer, pointer, integer]
        + [pointer] * 4
        + [integer] * 4
        + [pointer] * 4
        + [ctypes.c_float]
        + [pointer] * 2
        + [integer] * 2
    )
    for kernel in (
        library.ragspeed_gemv_f32,
        library.ragspeed_gemv_i8,
        library.ragspeed_gemv_q4,
        library.ragspeed_paged_decode_attention,
        library.ragspeed_add_rms_norm,
        library.ragspeed_decode_forward,
        library.ragspeed_place_kv,
        library.ragspeed_greedy_steps,
        library.ragspeed_to_f16,
        library.ragspeed_argmax,
    ):
        kernel.restype = None
    return library


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (turned off, not x86/ARM Linux, no compiler, or the build
    failed: logged once)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if platform.system() != "Linux" or compiler is None:
        log.info("CPU kernels off: needs Linux and a C compiler")
        return None
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), compiler, *FLAGS, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
        return _bind(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("CPU kernels off: building %s failed: %s", SOURCE.name, detail)
        return None
