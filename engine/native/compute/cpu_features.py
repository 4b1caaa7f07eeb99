"""What this CPU can do, for the choices that depend on it (engine.native.compute.quant's int8 prefill path).

`CpuFeatures` holds the instruction-set flags the kernels care about, read from the kernel's
/proc/cpuinfo (the same names as there), and torch's own view of the vector width it
dispatches to (`torch.backends.cpu.get_cpu_capability()`: "AVX512", "AVX2", "DEFAULT", ...).
Code that chooses by capability takes a `CpuFeatures` argument, so tests pass a made-up one;
`read_cpu_features()` is the one place that reads the machine.

- *VNNI* (`avx512_vnni` or `avx_vnni`): int8 dot products into int32 in one instruction.
  Without it, fbgemm's AVX2 kernel multiplies uint8 by int8 with `vpmaddubsw`, whose 16-bit
  pair sums saturate (two products of up to 255 x 127 each exceed 32,767).
- *bf16* (`avx512_bf16`, `amx_bf16`): bf16 products at speed; elsewhere bf16 is emulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ragspeed.environment import current

# /proc/cpuinfo flags recorded, in the order the start-up line lists them.
KNOWN_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]  # those of KNOWN_FLAGS this CPU reports
    torch_capability: str  # torch.backends.cpu.get_cpu_capability()

    def __post_init__(self) -> None:
        unknown = self.flags - set(KNOWN_FLAGS)
        if unknown:
            raise ValueError(f"unknown CPU flags {sorted(unknown)}; known: {list(KNOWN_FLAGS)}")

    @property
    def has_vnni(self) -> bool:
        return bool(self.flags & {"avx512_vnni", "avx_vnni"})

    @property
    def has_bf16(self) -> bool:
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        """One line for logs and benches: 'AMD EPYC (torch AVX2): avx2; no avx512f, ...'."""
        have = [f for f in KNOWN_FLAGS if f in self.flags]
        lack = [f for f in KNOWN_FLAGS if f not in self.flags]
        parts = [", ".join(have) or "none of the tracked flags"]
        if lack:
            parts.append("no " + ", ".join(lack))
        return f"{self.model_name} (torch {self.torch_capability}): " + "; ".join(parts)


def parse_cpuinfo(text: str, torch_capability: str) -> CpuFeatures:
    """The first processor's model name and flags in a /proc/cpuinfo text. Its family and model
    numbers join the name ("AMD EPYC, family 25 model 17"): a virtual machine's name often hides
    the generation (AMD's Zen 4 and Zen 5 both read "AMD EPYC"), and the rate of the same
    instructions differs between them (Zen 4 runs a 512-bit one in two halves)."""
    fields: dict[str, str] = {}
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags":
            flags = frozenset(value.split()) & set(KNOWN_FLAGS)
            break
        fields.setdefault(key, value.strip())
    model_name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        model_name += f", family {fields['cpu family']} model {fields['model']}"
    return CpuFeatures(model_name, flags, torch_capability)


# What each RAGSPEED_CPU_ISA leaves of the flags and of torch's capability (ragspeed.environment).
_ISA_FLAGS = {"avx2": frozenset({"avx2"}), "plain": frozenset()}
_ISA_CAPABILITY = {"avx2": "AVX2", "plain": "DEFAULT"}


def narrowed(features: CpuFeatures, isa: str) -> CpuFeatures:
    """`features` as a CPU of instruction sets `isa` has them ("native": as they are)."""
    if isa == "native":
        return features
    capability = features.torch_capability
    if capability not in ("DEFAULT", _ISA_CAPABILITY[isa]):
        capability = _ISA_CAPABILITY[isa]
    return CpuFeatures(features.model_name, features.flags & _ISA_FLAGS[isa], capability)


def read_cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """This machine's features (no flags where /proc/cpuinfo cannot be read), narrowed to
    `RAGSPEED_CPU_ISA`."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    features = parse_cpuinfo(text, torch.backends.cpu.get_cpu_capability())
    return narrowed(features, current().cpu_isa)
