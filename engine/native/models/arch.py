"""The shape of a decoder-only model, in primitives, read once from a checkpoint's config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    family: str  # a key of engine.native.loading.loader.FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2: biases on Q, K and V
    o_bias: bool = False  # Llama with attention_bias=True
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of each Q and K head before the rotation
    # A draft's LM head over a sub-vocabulary of its target (config `draft_vocab_size`): that
    # many rows, row i scoring target token d2t[i] (engine.native.core.spec_decode.draft). None: the head
    # has a row per token of the vocabulary.
    draft_vocab_size: int | None = None

    @property
    def num_logits(self) -> int:
        """Rows of the LM head: logits per position."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers, per byte of element size."""
        return 2 * self.num_layers * self.kv_size
