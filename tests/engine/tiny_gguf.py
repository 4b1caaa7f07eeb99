"""Tiny GGUF files written in the test session from tiny HF checkpoints, as llama.cpp's
convert_hf_to_gguf.py lays them out: llama.cpp tensor names, Q and K rows of the llama family
interleaved per head, norms in F32, matrices in the requested type; the tokenizer as
`tokenizer.ggml.*` metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
# Valid blocks of the K-quants the gguf package dequantizes but cannot write: random bytes, with
# the float16 scale fields (byte offsets in a block) set to small values. Other types (Q8_K, which
# nothing dequantizes) get random bytes only.
K_QUANT_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# Q4_K's dmin (byte offset, as a multiple of d): 7.5 d, so that the mins cancel the mean of the
# values (q in 0..15) as a trained model's do, and the random model does not favour one token.
K_QUANT_MINS = {"Q4_K": (2, 7.5)}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """transformers' Q/K row order to llama.cpp's (what its converter does to llama models)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_k_quant_bytes(
    qtype_name: str, rows: int, cols: int, seed: int, scale_range: tuple[float, float] = (0.001, 0.01)
) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype_name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scales = (rng.uniform(*scale_range, size=(blocks.shape[0], 1))).astype(np.float16).view(np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS.get(qtype_name, ()):
        blocks[:, offset : offset + 2] = scales
    if qtype_name in K_QUANT_MINS:
        offset, ratio = K_QUANT_MINS[qtype_name]
        blocks[:, offset : offset + 2] = (scales.view(np.float16) * ratio).view(np.uint8)
    return blocks.reshape(rows, cols // block_size * type_size)


def write_tiny_gguf(
    hf_dir: Path,
    out: Path,
    qtype: str = "F32",
    *,
    architecture: str = "llama",
    with_tokenizer: bool = True,
    k_quant_seed: int | None = None,
    k_quant_scale_range: tuple[float, float] | dict[str, tuple[float, float]] = (0.001, 0.01),
    types: dict[str, str] | None = None,
) -> Path:
    """`hf_dir`'s checkpoint as a GGUF file at `out`. `qtype`: the type of the matrices (F32, F16,
    BF16, Q8_0, Q4_0, Q4_1, ... any type gguf.quants.quantize writes); with `k_quant_seed`, `qtype`
    is a K-quant and the matrices are random valid blocks of it instead of the checkpoint's, their
    fp16 scale fields drawn from `k_quant_scale_range` (a dict: by type). `types` gives some
    matrices another type, by the end of their transformers name (as Q4_K_M files keep V in
    Q6_K: `{"v_proj.weight": "Q6_K"}`)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(out), architecture)
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // num_heads)
    writer.add_rope_freq_base(float(config.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if with_tokenizer:
        add_tokenizer(writer, hf_dir)

    for i, (name, tensor) in enumerate(tensors.items()):
        tensor_type = next((t for end, t in (types or {}).items() if name.endswith(end)), qtype)
        kind = GGMLQuantizationType[tensor_type]
        array = tensor.float().numpy()
        if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = interleave_rotary_rows(array, num_heads)
        elif architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = interleave_rotary_rows(array, num_kv_heads)
        if array.ndim == 1:  # norms and biases stay F32, as llama.cpp writes them
            writer.add_tensor(gguf_name(name), array.astype(np.float32))
        elif k_quant_seed is not None:
            scale_range = (
                k_quant_scale_range[tensor_type]
                if isinstance(k_quant_scale_range, dict)
                else k_quant_scale_range
            )
            data = random_k_quant_bytes(tensor_type, *array.shape, k_quant_seed + i, scale_range)
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_tokenizer(writer, hf_dir: Path) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp's `gpt2` tokenizer metadata."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_bos_token_id(special["<s>"])
    writer.add_eos_token_id(special["</s>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def source_tensor(hf_dir: Path, name: str) -> torch.Tensor:
    return load_file(str(hf_dir / "model.safetensors"))[name]
