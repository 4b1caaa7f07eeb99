"""Compile the kernel sources (`SOURCES`) once per machine into one library and load it with ctypes.

The library goes to `~/.cache/ragspeed/kernels/kernels-<hash>.so` (or the configured kernel
cache, `$RAGSPEED_KERNEL_CACHE`: ragspeed.environment),
the hash covering the sources and their headers, the compiler command and the CPU's model and flags,
so a changed source or another machine builds its own. It is compiled to a temporary name and
renamed, so processes starting at once never load half a file. It links the OpenMP runtime torch
already loaded (libgomp): the kernels share torch's threads instead of bringing their own. The
ctypes signatures are read from kernels.h, the header every source includes, so they cannot
disagree, and so are the ctypes structures and enum values that the callers pass (`structures`,
`enums`: engine.native.compute.cpu_kernels.decoder); the other headers hold what the sources share and export
nothing.

`RAGSPEED_CPU_KERNELS=0` turns the kernels off (oneDNN / fbgemm for every product); `CC` names
the compiler.

The engine runs the build for this CPU (`-march=native`). Tests also build the narrower ones
(`ISA_FLAGS`) and run them here for real: an AVX-512 CPU runs the AVX2 build's code (what an
AVX2-only machine compiles) and the plain C one, so every branch of the kernels is tested on one
machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from ragspeed.environment import CPU_ISAS, current

log = logging.getLogger(__name__)

# Package data; files on disk in every install (the compiler is given their paths).
_FOLDER = Path(str(resources.files("ragspeed.engine.native.compute.cpu_kernels")))
# Compiled together into one library: the decode products (fp32 and int8; GGUF's blocks),
# decode attention, the row-wise kernels (norm, argmax, KV placement), the decoder forward, the
# prefill products and prefill attention.
SOURCES = tuple(
    _FOLDER / name
    for name in (
        "gemv.c",
        "gemv_gguf.c",
        "attention.c",
        "rowwise.c",
        "decoder.c",
        "gemm_int8.c",
        "prefill_attention.c",
    )
)
HEADER = _FOLDER / "kernels.h"  # the exported prototypes and structs, read for the ctypes types
HEADERS = (HEADER, *(_FOLDER / name for name in ("kernels_common.h", "vector.h", "gemv.h", "internal.h")))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-lm", "-Werror=missing-prototypes")
# Builds for narrower CPUs than this one (tests): what is turned off after -march=native.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),  # an AVX2-only CPU (Zen 3): no AVX-512, no VNNI
    "plain": ("-mno-avx", "-Wno-psabi"),  # SSE only: the kernels' plain C branches
}


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def cache_dir() -> Path:
    """The folder of the compiled kernels (and of what is measured with them)."""
    return current().kernel_cache or Path.home() / ".cache" / "ragspeed" / "kernels"


def _compile(compiler: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        staged = Path(staging) / target.name
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(staged)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(staged, target)


_SCALARS = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^(\w+)\s+(ragspeed_\w+)\s*\(([^)]*)\)\s*;", re.MULTILINE)


def _ctype(declaration: str) -> type | None:
    """The ctypes type of a parameter or return type (`const float *x`, `int n`, `void`)."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [word for word in declaration.split() if word != "const"]
    if not words or words[0] not in _SCALARS:
        raise ValueError(f"{HEADER.name}: no ctypes type for {declaration!r}")
    return _SCALARS[words[0]]


def signatures(header: str) -> dict[str, tuple[type | None, list[type | None]]]:
    """Each exported function of the header text: its ctypes restype and argtypes."""
    text = _uncommented(header)
    found = {}
    for restype, name, parameters in _PROTOTYPE.findall(text):
        parameters = " ".join(parameters.split())
        arguments = [] if parameters in ("", "void") else parameters.split(",")
        found[name] = (_ctype(restype), [_ctype(argument) for argument in arguments])
    return found


_ENUM = re.compile(r"^enum\s+(\w+)\s*\{([^}]*)\}\s*;", re.MULTILINE)
_STRUCT = re.compile(r"^typedef\s+struct\s*\{([^}]*)\}\s*(\w+)\s*;", re.MULTILINE)
_FIELD_SCALARS: dict[str, type] = {"int": ctypes.c_int, "float": ctypes.c_float}


def _uncommented(header: str) -> str:
    return re.sub(r"/\*.*?\*/", "", header, flags=re.DOTALL)


def enums(header: str) -> dict[str, int]:
    """Each enumerator of the header's enums (`enum Name { A, B = 2 };`) and its value."""
    values = {}
    for _, body in _ENUM.findall(_uncommented(header)):
        value = 0
        for item in filter(None, (item.strip() for item in body.split(","))):
            name, _, given = (part.strip() for part in item.partition("="))
            value = int(given, 0) if given else value
            values[name] = value
            value += 1
    return values


def fields(header: str) -> dict[str, list[tuple[str, str]]]:
    """Each struct of the header (`typedef struct { ... } Name;`): its fields in order, each as
    (name, type): `int`, `float`, a struct above it, or a pointer (`float *`, `Layer *`)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for body, struct in _STRUCT.findall(_uncommented(header)):
        found[struct] = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            words = declaration.replace("*", " * ").split()
            words = [word for word in words if word != "const"]
            base, declarators = words[0], " ".join(words[1:]).split(",")
            for declarator in declarators:
                *stars, name = declarator.split()
                found[struct].append((name, f"{base} *" if stars else base))
    return found


def structures(header: str) -> dict[str, type[ctypes.Structure]]:
    """The header's structs as ctypes structures, in its order (a struct's fields may be the
    structs above it, or pointers to them)."""
    made: dict[str, type[ctypes.Structure]] = {}
    for struct, members in fields(header).items():
        layout: list[tuple[str, type]] = []
        for name, kind in members:
            if kind.endswith("*"):
                pointee = made.get(kind.removesuffix("*").strip())  # a struct's: typed
                layout.append((name, ctypes.c_void_p if pointee is None else ctypes.POINTER(pointee)))
            elif kind in made:
                layout.append((name, made[kind]))
            elif kind in _FIELD_SCALARS:
                layout.append((name, _FIELD_SCALARS[kind]))
            else:
                raise ValueError(f"{HEADER.name}: no ctypes type for {struct}.{name} ({kind})")
        made[struct] = type(struct, (ctypes.Structure,), {"_fields_": layout})
    return made


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in signatures(HEADER.read_text()).items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


@functools.cache
def load_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, or None (turned off, not x86/ARM Linux, no compiler, or the build
    failed: logged once). `isa` other than "native" builds for a narrower CPU (`ISA_FLAGS`);
    never wider than `RAGSPEED_CPU_ISA` (ragspeed.environment), which None takes."""
    if not current().cpu_kernels:
        return None
    allowed = current().cpu_isa
    isa = min(isa or allowed, allowed, key=CPU_ISAS[::-1].index)  # CPU_ISAS: widest first
    compiler = shutil.which(current().compiler) or shutil.which("gcc")
    if platform.system() != "Linux" or compiler is None:
        log.info("CPU kernels off: needs Linux and a C compiler")
        return None
    flags = FLAGS + ISA_FLAGS[isa]
    key = hashlib.sha256(
        "\n".join([*(p.read_text() for p in SOURCES + HEADERS), compiler, *flags, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"kernels-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target, flags)
        return _bind(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("CPU kernels off: building %s failed: %s", " + ".join(p.name for p in SOURCES), detail)
        return None
