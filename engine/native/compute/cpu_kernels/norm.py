"""The residual add and RMSNorm of a decoder layer in one call of the kernels (rowwise.c).

torch's `rms_norm` runs as six small ops on a CPU (pow, mean, add, rsqrt, mul, mul) and the
residual add is a seventh; a decode step of bench-135m runs 61 of these groups, at 15-30 us
each. rowwise.c does each in one pass per row.
"""

from __future__ import annotations

import torch

from ragspeed.engine.native.compute.cpu_kernels.build import load_library


def add_rms_norm_applies(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and load_library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [rows, dim] += residual (in place, when given); returns rms_norm(x) * weight."""
    out = torch.empty_like(x)
    residual_ptr = None
    if residual is not None:
        residual = residual.contiguous()
        residual_ptr = residual.data_ptr()
    library = load_library()
    assert library is not None, "add_rms_norm_applies checks for the kernels"
    library.ragspeed_add_rms_norm(
        x.data_ptr(),
        residual_ptr,
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return out
