"""What every linear kind shares (engine.native.models.linear's dense one, engine.native.compute.quant's int8 one).

A kind is built empty from its shape, then `load` checks the float weight and bias it is given
(`check_weights`) and packs them once. `num_threads` records torch's thread count at load: the
engine loads on its own count, and the products run on it (engine.native.compute.threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn


class Shaped(Protocol):
    """A weight as `check_weights` reads it: a tensor, or a GGUF file's blocks."""

    @property
    def shape(self) -> Sequence[int]: ...


class LinearKind(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.num_threads = 1  # set by load

    def load(self, weight: Any, bias: torch.Tensor | None = None) -> None:
        """Check `weight` ([out_features, in_features]) and `bias` and pack them (each kind its
        own way; the weight's type is the kind's: a tensor, or a GGUF file's blocks)."""
        raise NotImplementedError

    def check_weights(self, weight: Shaped, bias: torch.Tensor | None) -> None:
        """Refuse a weight ([out_features, in_features]) or bias that does not fit; note the
        thread count of this load."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit a linear "
                f"{self.in_features} -> {self.out_features}"
            )
        if self.has_bias != (bias is not None):
            raise ValueError(f"linear expects bias={self.has_bias}, got {bias is not None}")
        self.num_threads = torch.get_num_threads()

    def blocked_weight(self):
        """The weight in the layout of ragspeed's CPU kernels (engine.native.compute.cpu_kernels.BlockedWeight)
        that decode steps read, or None where the kind keeps none."""
        return None

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features
