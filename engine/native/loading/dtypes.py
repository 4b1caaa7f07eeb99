"""What `--dtype` names: the policy `DTYPES` (which prefill path precisions each admits on CPU,
which one it requires) and the dtype the weights compute in (engine.native.core.precision plans the
prefill paths from it, after loading)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragspeed.engine.native.compute.cpu_features import CpuFeatures


class DtypeUnavailableError(ValueError):
    """An unknown `--dtype`, or one this CPU cannot run."""


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # the --dtype value
    admits: frozenset[str]  # the prefill path precisions it allows on CPU
    requires: str | None = None  # a precision the CPU must run, else a start-up error
    gpu_dtype: torch.dtype | None = None  # the compute dtype elsewhere; None: auto
    # whether the prefill attention's products may run on int16 where the quality gate passes
    # them (engine.native.core.precision): auto's "fastest that keeps the answers" alone
    int16_attention: bool = False


DTYPES: dict[str, DtypeChoice] = {
    choice.name: choice
    for choice in (
        DtypeChoice("auto", frozenset({"bf16", "int8", "fp32"}), int16_attention=True),
        DtypeChoice("float32", frozenset({"int8", "fp32"}), gpu_dtype=torch.float32),
        DtypeChoice("bfloat16", frozenset({"bf16", "fp32"}), requires="bf16", gpu_dtype=torch.bfloat16),
        # fp16 has no fast CPU products: on CPU it computes as float32.
        DtypeChoice("float16", frozenset({"int8", "fp32"}), gpu_dtype=torch.float16),
    )
}


def dtype_choice(name: str) -> DtypeChoice:
    choice = DTYPES.get(name)
    if choice is None:
        raise DtypeUnavailableError(f"unknown dtype {name!r}; choices: {', '.join(DTYPES)}")
    return choice


def model_dtype(name: str, device: str | torch.device, features: CpuFeatures) -> torch.dtype:
    """The dtype a whole-model backend (transformers) computes in for `--dtype name`: on CPU,
    `auto` is bf16 where the CPU multiplies it at speed and fp32 elsewhere."""
    choice = dtype_choice(name)
    if choice.gpu_dtype is not None:
        return choice.gpu_dtype
    if torch.device(device).type == "cpu":
        return torch.bfloat16 if features.has_bf16 else torch.float32
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if cuda_bf16 else torch.float32


def compute_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The native engine's weights and activations: fp32 on CPU (a bf16 prefill path keeps
    its own bf16 copy), `model_dtype` elsewhere."""
    choice = dtype_choice(name)
    if torch.device(device).type == "cpu":
        return torch.float32
    return model_dtype(choice.name, device, CpuFeatures("none", frozenset(), "DEFAULT"))
