"""One decoder-only transformer for the Llama, Qwen2, Qwen3 and Mistral families.

The families differ only in flags of `ModelArch` (QKV bias, Q/K norm, tied embeddings), so one
code path serves them all. The model works on a flat batch: every scheduled token of every
request in one `[num_tokens, hidden_size]` tensor, prefill chunks and decodes alike; only
attention looks at request boundaries, through `AttentionMetadata`.

Hot-path rules (per-op overhead dominates small models on CPU): fused QKV and gate-up
projections, one rotary op for Q and K together, the residual add fused into the norm (one
call of ragspeed's CPU kernels on a CPU), rotations looked up once per step, no dictionaries in
the layer loop.
"""

from __future__ import annotations

import itertools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ragspeed.engine.native.compute.attention import paged_attention
from ragspeed.engine.native.compute.attention_metadata import AttentionMetadata
from ragspeed.engine.native.compute.cpu_kernels.decoder import FusedDecoder
from ragspeed.engine.native.compute.cpu_kernels.norm import add_rms_norm, add_rms_norm_applies
from ragspeed.engine.native.compute.quant.gguf_blocks import GgufBlocks
from ragspeed.engine.native.models.arch import ModelArch
from ragspeed.engine.native.models.linear import build_linear
from ragspeed.engine.native.models.rotary import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.size = (size,)
        self.eps = eps
        self.weight = torch.ones(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.size, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's next value, `x + residual` (written into x; x itself when
        residual is None), and its norm: (norm, stream)."""
        if add_rms_norm_applies(x) and self.weight.dtype == torch.float32:
            return add_rms_norm(x, residual, self.weight, self.eps), x
        stream = x if residual is None else x.add_(residual)
        return self(stream), stream


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, quantization: str | None):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.q_size
        self.kv_size = arch.kv_size
        self.scale = arch.head_dim**-0.5
        self.eps = arch.rms_norm_eps
        self.qkv_proj = build_linear(
            arch.hidden_size,
            arch.q_size + 2 * arch.kv_size,
            bias=arch.qkv_bias,
            quantization=quantization,
        )
        self.o_proj = build_linear(arch.q_size, arch.hidden_size, bias=arch.o_bias, quantization=quantization)
        # Qwen3: one weight row per Q head then per K head, so Q and K are normed in one op.
        self.qk_norm_weight: torch.Tensor | None = None  # [num_heads + num_kv_heads, head_dim]

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        freqs_cis: torch.Tensor,  # [num_tokens, 1, head_dim/2]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        if self.qk_norm_weight is not None:
            qk = F.rms_norm(qk, (self.head_dim,), None, self.eps) * self.qk_norm_weight
        qk = apply_rotary(qk, freqs_cis)
        q = qk[:, : self.num_heads]  # [num_tokens, num_heads, head_dim]
        k = qk[:, self.num_heads :]  # [num_tokens, num_kv_heads, head_dim]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out)  # out: [num_tokens, num_heads * head_dim]


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, quantization: str | None):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = build_linear(
            arch.hidden_size,
            2 * arch.intermediate_size,
            bias=arch.mlp_bias,
            quantization=quantization,
        )
        self.down_proj = build_linear(
            arch.intermediate_size,
            arch.hidden_size,
            bias=arch.mlp_bias,
            quantization=quantization,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, quantization: str | None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, quantization)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, quantization)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        freqs_cis: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `residual` carries the stream; `hidden` is the last sublayer's output not yet added.
        normed, residual = self.input_layernorm.add_norm(hidden, residual)
        hidden = self.self_attn(normed, freqs_cis, k_cache, v_cache, meta)
        normed, residual = self.post_attention_layernorm.add_norm(hidden, residual)
        return self.mlp(normed), residual


class DecoderLM(nn.Module):
    def __init__(self, arch: ModelArch, quantization: str | None = None):
        super().__init__()
        self.arch = arch
        # [vocab_size, hidden_size]: a tensor, or a GGUF file's blocks (looked up row by row)
        self.embed_tokens: torch.Tensor | GgufBlocks | None = None
        self.layers = nn.ModuleList(DecoderLayer(arch, quantization) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Quantized too: a tied head quantizes its own copy (a GGUF head keeps the file's blocks).
        self.lm_head = build_linear(arch.hidden_size, arch.num_logits, quantization=quantization, head=True)
        # A sub-vocabulary head's map, head row -> token id, [num_logits] int64; else None.
        self.d2t: torch.Tensor | None = None
        # Decode-type steps in one call of ragspeed's CPU kernels, where they run this model
        # (engine.native.compute.cpu_kernels.decoder); built at the first such step, once the weights are in.
        self.fused_decode = True
        self._fused: FusedDecoder | Literal[False] | None = None  # False: the kernels cannot run it

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        freqs_cis: torch.Tensor,  # [num_tokens, 1, head_dim/2], RotaryEmbedding.lookup(positions)
        k_caches: list[torch.Tensor],  # per layer [num_slots, num_kv_heads, head_dim]
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states of every token: [num_tokens, hidden_size]."""
        hidden = self.embed(input_ids)
        fused = self._fused_decoder()
        rows = fused and FusedDecoder.rows(meta, hidden.shape[0])
        if fused is not None and rows:
            return fused.forward(hidden, freqs_cis, k_caches, v_caches, meta, rows)
        hidden, residual = self.run_layers(hidden, None, freqs_cis, k_caches, v_caches, meta, 0)
        return self.norm.add_norm(hidden, residual)[0]

    def sample_logits(
        self,
        input_ids: torch.Tensor,
        freqs_cis: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,  # the tokens that sample; None: every token
    ) -> torch.Tensor:
        """fp32 logits [num_rows, num_logits] of the sampling tokens: the embedding lookup, the
        forward and the LM head in one call of the kernels where every token samples and the
        step is theirs."""
        fused = self._fused_decoder()
        if rows is None and fused is not None and fused.head is not None:
            decode_rows = FusedDecoder.rows(meta, len(input_ids))
            if decode_rows:
                hidden = None if fused.embeds else self.embed(input_ids)
                return fused.logits(input_ids, hidden, freqs_cis, k_caches, v_caches, meta, decode_rows)
        hidden = self(input_ids, freqs_cis, k_caches, v_caches, meta)
        return self.compute_logits(hidden if rows is None else hidden[rows])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> the tokens' embeddings [num_tokens, hidden_size]."""
        if isinstance(self.embed_tokens, GgufBlocks):
            return self.embed_tokens.lookup(input_ids)
        assert self.embed_tokens is not None, "the weights are not loaded"
        return F.embedding(input_ids, self.embed_tokens)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its embeddings'; the KV cache's by default)."""
        assert self.embed_tokens is not None, "the weights are not loaded"
        return torch.float32 if isinstance(self.embed_tokens, GgufBlocks) else self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        assert self.embed_tokens is not None, "the weights are not loaded"
        return self.embed_tokens.data.device  # a tensor's `data` is itself, the blocks' their bytes

    def run_layers(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the last sublayer's output not yet added
        residual: torch.Tensor | None,  # the residual stream so far; None before layer 0
        freqs_cis: torch.Tensor,
        k_caches: list[torch.Tensor],  # of the layers run, from layer `first` on
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        first: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers `first ..` (as many as `k_caches`), layer by layer: (hidden, residual), whose
        sum is the residual stream after the last one (a partial forward: engine.native.core.document_kv)."""
        for layer, k_cache, v_cache in zip(itertools.islice(self.layers, first, None), k_caches, v_caches):
            hidden, residual = layer(hidden, residual, freqs_cis, k_cache, v_cache, meta)
        assert residual is not None
        return hidden, residual

    def _fused_decoder(self) -> FusedDecoder | None:
        if not self.fused_decode:
            return None
        if self._fused is None:
            self._fused = FusedDecoder(self) if FusedDecoder.supports(self) else False
        return self._fused or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_sequences, hidden_size] -> fp32 logits [num_sequences, num_logits]."""
        return self.lm_head(hidden).float()

    @property
    def num_weight_bytes_per_token(self) -> int:
        """Weight bytes one decode step reads: every projection and the LM head."""
        return sum(getattr(m, "num_weight_bytes", 0) for m in self.modules())
