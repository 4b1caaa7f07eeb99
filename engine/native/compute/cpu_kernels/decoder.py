"""Every decoder layer of a decode-type step in one call of the kernels (`ragspeed_decode_forward`).

A decode step of a small model is bound by the ops between its products: about fifteen torch
ops and module calls per layer, each some microseconds. The demo model (8 layers, 7M
parameters): 2.2 ms a step of which its products take 1.0 ms; its 2-layer draft 0.7 ms of which
0.2. `FusedDecoder` hands the whole layer stack to decoder.c instead: the same blocked products,
norms and paged attention, with the rotation, Q/K norm, K/V write and SiLU gate in C. Where
every token of the step samples (decodes, verifications), the embedding lookup (fp32 rows or a
GGUF file's Q8_0 blocks) and the LM head's product join the same call, the head in the same
parallel region.
`greedy_steps` runs a draft model's whole proposal (catch-up and k greedy steps) in one call
the same way.

It applies to models whose every projection has a blocked copy (fp32, int8, 4-bit, a GGUF
K-quant's or a mix of GGUF types', on a CPU with the kernels built) and to steps whose every
query is a row of the decode-attention kernel (decodes, verifications, a draft's short
catch-up: engine.native.compute.cpu_kernels.decode_step). Rows are computed alike whatever their number, so
greedy output stays the same with and without speculation.
Elsewhere (prefill chunks, GPUs) the model runs layer by layer.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from ragspeed.engine.native.compute.cpu_kernels.attention import KV_DTYPES, MAX_GROUP, MAX_HEAD_DIM
from ragspeed.engine.native.compute.cpu_kernels.blocked import (
    BLOCKED_KINDS,
    BlockedWeight,
    gather_weights,
    in_decode_step,
)
from ragspeed.engine.native.compute.cpu_kernels.build import HEADER, enums, load_library, structures
from ragspeed.engine.native.compute.step_buffers import RowBuffer, StepBuffers

if TYPE_CHECKING:
    from ragspeed.engine.native.compute.attention_metadata import AttentionMetadata


# kernels.h's structs as ctypes structures and its WEIGHT_* values, read from the header by the
# parser that binds the functions (build.structures, build.enums): one declaration, in C.
_STRUCTURES = structures(HEADER.read_text())
_Linear, _Layer, _Model = _STRUCTURES["Linear"], _STRUCTURES["Layer"], _STRUCTURES["Model"]
# BlockedWeight.kind -> the WeightKind of a Linear (kernels.h)
_WEIGHT_KINDS = enums(HEADER.read_text())
_KINDS = {kind: _WEIGHT_KINDS[f"WEIGHT_{kind.upper()}"] for kind in BLOCKED_KINDS}


def _filled(structure: type[ctypes.Structure], **values) -> ctypes.Structure:
    """One of kernels.h's structs with every field given by name: a field the header renames,
    adds or drops fails here instead of shifting the others (ctypes keeps unknown names)."""
    names = [field[0] for field in structure._fields_]
    assert sorted(values) == sorted(names), f"{structure.__name__} has the fields {names}"
    return structure(**values)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _half(caches: list[torch.Tensor]) -> bool:
    """Whether the KV pool holds fp16 (else fp32: engine.native.compute.cpu_kernels.attention.KV_DTYPES)."""
    assert caches[0].dtype in KV_DTYPES, caches[0].dtype
    return caches[0].dtype == torch.float16


def _projections(layer) -> tuple:
    """A decoder layer's four linear kinds, in the order of kernels.h's `Layer`."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _linear(weight: BlockedWeight) -> ctypes.Structure:
    return _filled(
        _Linear,
        w=weight.blocks.data_ptr(),
        scale=_pointer(weight.scales),
        bias=_pointer(weight.bias),
        n=weight.out_features,
        k=weight.in_features,
        kind=_KINDS[weight.kind],
    )


class FusedDecoder:
    """The layer stack of one loaded `DecoderLM` as kernels.h's structs (pointers into the
    model's own tensors, which it keeps alive)."""

    def __init__(self, model) -> None:
        arch = model.arch
        library = load_library()
        assert library is not None, "FusedDecoder.supports checks for the kernels"
        self.library = library
        # What the structs point into: the model's own tensors where fp32 and contiguous already.
        self._keep: list[torch.Tensor] = []
        lm_head = model.lm_head.blocked_weight()
        weights = [p.blocked_weight() for layer in model.layers for p in _projections(layer)]
        gather_weights([w for w in [*weights, lm_head] if w is not None])
        layers = []
        for layer in model.layers:
            qk_norm = layer.self_attn.qk_norm_weight
            qkv, o, gate_up, down = (_linear(p.blocked_weight()) for p in _projections(layer))
            layers.append(
                _filled(
                    _Layer,
                    input_norm=self._float(layer.input_layernorm.weight),
                    post_norm=self._float(layer.post_attention_layernorm.weight),
                    qk_norm=None if qk_norm is None else self._float(qk_norm),
                    qkv=qkv,
                    o=o,
                    gate_up=gate_up,
                    down=down,
                )
            )
        self.layers = (_Layer * len(layers))(*layers)
        # The kernels look the embeddings up where they are fp32 rows or a GGUF file's Q8_0
        # blocks (`embeds`); the LM head joins the call where it has a blocked copy (`head`);
        # the greedy steps (a draft's) need both.
        embed = model.embed_tokens
        fp32_embed = isinstance(embed, torch.Tensor)
        q8_embed = getattr(embed, "qtype", None) == "Q8_0"
        self.embeds = fp32_embed or q8_embed
        self.head = lm_head
        self.greedy = lm_head is not None and self.embeds
        # Whether a prefill chunk's rows may attend in the prefill kernel (meta.row_spans): its
        # condition beyond the decode kernel's (`supports`), head_dim in whole vectors of 16.
        self.spans = arch.head_dim % 16 == 0
        self.model = _filled(
            _Model,
            layers=self.layers,
            num_layers=len(layers),
            hidden=arch.hidden_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            inter=arch.intermediate_size,
            eps=arch.rms_norm_eps,
            scale=arch.head_dim**-0.5,
            final_norm=self._float(model.norm.weight),
            embed=self._float(embed) if fp32_embed else None,
            embed_q8=self._keep_pointer(embed.data) if q8_embed else None,
            lm_head=_Linear() if lm_head is None else _linear(lm_head),
        )
        # The last pools' first K and V tensors (identity: tensors hold their memory), pointers.
        self._caches: tuple[tuple[torch.Tensor, torch.Tensor], ctypes.Array, ctypes.Array] | None = None
        self._kv_half = False  # whether the pool of `_caches` holds fp16
        # The logits call's buffers, kept across steps: the embeddings it looks up, the final
        # hidden states it writes beside the logits, and the logits it returns.
        self._embeddings = RowBuffer((arch.hidden_size,), torch.float32)
        self._final = RowBuffer((arch.hidden_size,), torch.float32)
        self._scores = RowBuffer((0 if lm_head is None else lm_head.out_features,), torch.float32)

    def _float(self, tensor: torch.Tensor) -> int:
        return self._keep_pointer(tensor.float())

    def _keep_pointer(self, tensor: torch.Tensor) -> int:
        tensor = tensor.contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    @staticmethod
    def supports(model) -> bool:
        """Whether the kernels can run this model's decode steps."""
        arch = model.arch
        if (
            load_library() is None
            or model.embed_tokens is None
            or model.device.type != "cpu"
            or model.dtype != torch.float32
            or arch.num_heads // arch.num_kv_heads > MAX_GROUP
            or arch.head_dim > MAX_HEAD_DIM
            or arch.head_dim % 2
        ):
            return False
        return all(p.blocked_weight() is not None for layer in model.layers for p in _projections(layer))

    @staticmethod
    def rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each query's block table and context length when this step is decode-type and
        every query is a row of the decode-attention kernel; else None."""
        if not in_decode_step():
            return None
        if meta.row_block_tables is not None:
            assert meta.row_context_lens is not None  # set together
            return meta.row_block_tables, meta.row_context_lens
        if meta.num_decodes == num_tokens and meta.decode_block_tables is not None:
            assert meta.decode_context_lens is not None  # set together
            return meta.decode_block_tables, meta.decode_context_lens
        return None

    def _cache_arrays(
        self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]
    ) -> tuple[ctypes.Array, ctypes.Array]:
        cached = self._caches
        if cached is None or cached[0][0] is not k_caches[0] or cached[0][1] is not v_caches[0]:
            self._kv_half = _half(k_caches)
            pointers = ctypes.c_void_p * len(k_caches)
            cached = self._caches = (
                (k_caches[0], v_caches[0]),
                pointers(*(c.data_ptr() for c in k_caches)),
                pointers(*(c.data_ptr() for c in v_caches)),
            )
        return cached[1], cached[2]

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size] embeddings (overwritten)
        freqs_cis: torch.Tensor,  # [num_tokens, 1, head_dim/2] complex64
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        rows: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] (after the last norm)."""
        return self._run(None, hidden.contiguous(), freqs_cis, k_caches, v_caches, meta, rows, None)

    def logits(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor | None,  # their embeddings; None where `embeds` (looked up here)
        freqs_cis: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        rows: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The LM head's fp32 logits of every token [num_tokens, num_logits] (where `head` is
        set): the embedding lookup (where `embeds`), the layers and the head in one call. The
        logits are a buffer that the next call of `logits` overwrites."""
        assert self.head is not None, "the LM head has no blocked copy"
        num_tokens = input_ids.shape[0]
        self._scores.reserve(num_tokens)
        self._final.reserve(num_tokens)
        ids = None
        if hidden is None:
            assert self.embeds, "these embeddings are looked up in Python"
            self._embeddings.reserve(num_tokens)
            hidden = self._embeddings.rows(num_tokens)
            ids = input_ids.contiguous()
        scores = self._scores.rows(num_tokens)
        out = self._final.rows(num_tokens)
        return self._run(ids, hidden.contiguous(), freqs_cis, k_caches, v_caches, meta, rows, scores, out)

    def decode_logits(
        self,
        buffers: StepBuffers,  # the step's tokens and kernel rows, written
        num_tokens: int,
        block_size: int,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        num_threads: int,
    ) -> torch.Tensor:
        """`logits` of a step whose every token is a row of the decode kernel, read from the
        model runner's step buffers (StepBuffers.tokens, then .kernel_rows) as they are: the
        embedding lookup, the layers and the head in one call, touching no tensor on the way
        (after the weights streamed through the caches, each torch call costs microseconds).
        The same buffer as `logits`'."""
        assert self.head is not None and self.embeds, "the head and the embeddings must be the kernels'"
        embeddings, final, scores = self._embeddings, self._final, self._scores
        embeddings.reserve(num_tokens)
        final.reserve(num_tokens)
        scores.reserve(num_tokens)
        k_pointers, v_pointers = self._cache_arrays(k_caches, v_caches)
        tables = buffers.block_tables
        self.library.ragspeed_decode_forward(
            ctypes.byref(self.model),
            k_pointers,
            v_pointers,
            buffers.token_ids.address,
            embeddings.address,
            final.address,
            scores.address,
            buffers.rotations.address,
            buffers.slot_mapping.address,
            tables.address,
            buffers.context_lens.address,
            tables.row_shape[0],
            block_size,
            num_tokens,
            0,
            None,
            0,
            self._kv_half,
            num_threads,
        )
        return scores.rows(num_tokens)

    def _run(self, ids, hidden, freqs_cis, k_caches, v_caches, meta, rows, scores, out=None) -> torch.Tensor:
        tables, context_lens = rows
        spans = meta.row_spans if self.spans else ()
        rotations = freqs_cis.contiguous()
        if out is None:
            out = torch.empty_like(hidden)
        k_pointers, v_pointers = self._cache_arrays(k_caches, v_caches)
        self.library.ragspeed_decode_forward(
            ctypes.byref(self.model),
            k_pointers,
            v_pointers,
            _pointer(ids),
            hidden.data_ptr(),
            out.data_ptr(),
            _pointer(scores),
            rotations.data_ptr(),
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            context_lens.data_ptr(),
            tables.shape[1],
            meta.block_size,
            hidden.shape[0],
            len(spans),
            (ctypes.c_int32 * len(spans))(*spans) if spans else None,
            meta.int16_attention,
            _half(k_caches),
            meta.num_threads,
        )
        return out if scores is None else scores

    def greedy_steps(
        self,
        rotation_table: torch.Tensor,  # [max_positions, head_dim/2] complex64
        vocab_size: int,  # the argmax runs over the first vocab_size logits
        d2t: torch.Tensor | None,  # [num_logits] int64: head row -> token id; None: identity
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64, blocks for every step
        block_size: int,
        fed: list[list[int]],  # each sequence's tokens to feed first (one or more)
        positions: list[int],  # the position of each sequence's first fed token
        num_steps: list[int],  # tokens to decode for each
        min_confidence: float,
        num_threads: int,
    ) -> list[list[int]]:
        """Greedy decoding of each sequence after its fed tokens, for its `num_steps` tokens, in
        one call (decoder.c's `ragspeed_greedy_steps`; a token whose softmax probability is
        below `min_confidence` is its sequence's last); returns each sequence's new tokens
        (token ids: a sub-vocabulary head's argmax row mapped through `d2t`)."""
        num_seqs, max_steps = len(fed), max(num_steps)
        drafts = torch.zeros(num_seqs, max_steps, dtype=torch.long)
        counts = torch.zeros(num_seqs, dtype=torch.int32)
        fed_t = torch.tensor([t for tokens in fed for t in tokens], dtype=torch.long)
        num_fed_t = torch.tensor([len(tokens) for tokens in fed], dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.long)
        steps_t = torch.tensor(num_steps, dtype=torch.int32)
        k_pointers, v_pointers = self._cache_arrays(k_caches, v_caches)
        self.library.ragspeed_greedy_steps(
            ctypes.byref(self.model),
            rotation_table.data_ptr(),
            vocab_size,
            _pointer(d2t),
            k_pointers,
            v_pointers,
            block_tables.data_ptr(),
            block_tables.shape[1],
            block_size,
            _half(k_caches),
            num_seqs,
            fed_t.data_ptr(),
            num_fed_t.data_ptr(),
            positions_t.data_ptr(),
            steps_t.data_ptr(),
            min_confidence,
            drafts.data_ptr(),
            counts.data_ptr(),
            max_steps,
            num_threads,
        )
        return [row[:count] for row, count in zip(drafts.tolist(), counts.tolist())]
