"""Rotary position embedding as one complex multiplication.

Hugging Face checkpoints rotate dimension `j` of a head with dimension `j + head_dim/2`
("rotate half"). The loader permutes the rows of the Q and K projections within each head so
that these two dimensions become neighbours (`2j`, `2j + 1`); the rotation is then a complex
product with `polar(attention_scaling, position * inv_freq[j])`: one op instead of six. The
permutation is applied to Q and K alike, so their dot products (and the cached K) are unchanged
in meaning; V is never permuted.

Because every rotation is `position * inv_freq`, a key cached at position p moves to position
p + delta by one more product with `polar(1, delta * inv_freq)` (llama.cpp's K-shift): a
document's KV computed once is placed anywhere (engine.native.core.document_kv). That holds for every rope
type whose frequencies do not depend on the sequence length (`SHIFTABLE_ROPE_TYPES`).
"""

from __future__ import annotations

import torch

# Rope types of transformers' ROPE_INIT_FUNCTIONS whose rotation is position * a fixed inv_freq
# (scaled or not); "dynamic" and "longrope" change their frequencies with the sequence length.
SHIFTABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def rotate_half_permutation(head_dim: int) -> torch.Tensor:
    """Row order turning HF's (j, j + head_dim/2) pairs into neighbours (2j, 2j + 1)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def permute_heads(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the rows of a Q or K projection (weight [H*D, in] or bias [H*D]) head by head."""
    perm = rotate_half_permutation(head_dim)
    shaped = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return shaped[:, perm].reshape(weight.shape)


class RotaryEmbedding:
    """A table of rotations for every position up to `max_positions`."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        attention_scaling: float = 1.0,
        device: torch.device | str = "cpu",
        rope_type: str = "default",
    ):
        self.rope_type = rope_type
        self.inv_freq = inv_freq.float().to(device)  # [head_dim/2]
        # fp32 angles exactly as transformers computes them, so greedy outputs match it.
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.float())  # [max_positions, head_dim/2]
        magnitude = torch.full_like(angles, float(attention_scaling))
        self.freqs_cis = torch.polar(magnitude, angles).to(device)  # complex64

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations of a step's tokens, shared by all layers: [num_tokens, 1, head_dim/2]."""
        return self.freqs_cis[positions].unsqueeze(1)

    @property
    def shiftable(self) -> bool:
        """Whether cached keys can be moved to another position by `shift_keys`."""
        return self.rope_type in SHIFTABLE_ROPE_TYPES

    def shift_rotation(self, delta: int) -> torch.Tensor:
        """The unit rotation of a shift by `delta` positions, per pair: [head_dim/2] complex64.
        The angle is taken in fp64, so the shift adds no rounding of its own to the cached one's."""
        angles = delta * self.inv_freq.double()
        return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    def shift_keys(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys rotated at positions p (`[..., num_kv_heads, head_dim]`, pairs adjacent) as if
        rotated at p + delta: one product with the unit rotation of `delta`; fp32 out."""
        pairs = keys.float().reshape(*keys.shape[:-1], keys.shape[-1] // 2, 2)
        rotation = self.shift_rotation(delta).to(keys.device)
        return torch.view_as_real(torch.view_as_complex(pairs) * rotation).reshape(keys.shape)


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] (pairs adjacent) -> rotated, same shape and dtype."""
    num_tokens, num_heads, head_dim = x.shape
    pairs = x.float().reshape(num_tokens, num_heads, head_dim // 2, 2)
    rotated = torch.view_as_real(torch.view_as_complex(pairs) * freqs_cis)
    return rotated.reshape(num_tokens, num_heads, head_dim).to(x.dtype)
