"""Load Hugging Face-format checkpoints (config.json + safetensors + tokenizer) into `DecoderLM`.

GGUF files, zoo names and hub ids reach this loader as HF-format folders: `resolve_model_path`
converts or downloads them first (engine.native.loading.model_zoo, engine.native.loading.gguf).

One code path for every supported family; a family is a row of `FAMILIES`, found by the
config's `architectures` or `model_type`. Weights are read from every `*.safetensors` file of
the folder (sharded checkpoints too), converted to the compute dtype, and fused at load:
Q, K, V into one projection (Q and K rows permuted for the one-op rotation, see
`engine.native.models.rotary`), gate and up into another. Every checkpoint is computed in fp32 on CPU;
where the CPU multiplies bf16 at speed, prefill products may read a bf16 copy of the weights
(engine.native.core.precision plans and chooses it, after loading: the loader knows nothing of it).

With quantization 'gguf' (what 'auto' picks on CPU for a converted GGUF file), the matrices
whose type the kernels decode (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) are read from the source file as
its blocks (engine.native.compute.quant.gguf_blocks) instead of the copy's fp32 values; rows are permuted and
fused the same way, block rows as they are (a fused projection whose parts differ in type, as
Q4_K_M's QKV, holds each part's blocks and decodes on the mixed kernel).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.quant import (
    QuantizationUnavailableError,
    available_quantizations,
    check_quantization,
)
from ragspeed.engine.native.compute.quant.gguf_blocks import KERNEL_TYPES, GgufBlocks, cat_rows, map_rows
from ragspeed.engine.native.compute.threads import cpu_threads
from ragspeed.engine.native.loading import gguf
from ragspeed.engine.native.loading.dtypes import compute_dtype
from ragspeed.engine.native.models.arch import ModelArch
from ragspeed.engine.native.models.decoder import DecoderLayer, DecoderLM
from ragspeed.engine.native.models.rotary import RotaryEmbedding, permute_heads

logger = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one the native engine implements."""


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    qkv_bias: bool = False  # bias on Q, K, V regardless of config.attention_bias
    qk_norm: bool = False


FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily("llama", ("LlamaForCausalLM",), ("llama",)),
        ModelFamily("mistral", ("MistralForCausalLM",), ("mistral",)),
        ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True),
        ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True),
    )
}


@dataclass
class LoadedModel:
    model: DecoderLM
    rotary: RotaryEmbedding
    arch: ModelArch
    max_model_len: int  # the model's own context limit (sliding window included)
    eos_token_ids: tuple[int, ...]
    path: Path
    quantization: str | None = None  # what "auto" chose, or as asked


def find_family(hf_config: Any) -> ModelFamily:
    architectures = tuple(getattr(hf_config, "architectures", None) or ())
    model_type = getattr(hf_config, "model_type", None)
    for family in FAMILIES.values():
        if set(architectures) & set(family.architectures) or model_type in family.model_types:
            return family
    supported = ", ".join(a for f in FAMILIES.values() for a in f.architectures)
    raise UnsupportedModelError(
        f"model architecture {list(architectures) or model_type!r} is not supported by the native "
        f"engine; supported: {supported} (use backend 'transformers' for others)"
    )


def arch_from_config(hf_config: Any, family: ModelFamily) -> ModelArch:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelArch(
        family=family.name,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=family.qk_norm,
        draft_vocab_size=getattr(hf_config, "draft_vocab_size", None) or None,
    )


def context_limit(hf_config: Any) -> int:
    """The longest context the checkpoint serves exactly: sliding-window attention is not
    implemented, so a window shorter than the positions caps the context."""
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None) or ()
    uses_window = "sliding_attention" in layer_types or (getattr(hf_config, "model_type", "") == "mistral")
    if window and uses_window:
        limit = min(limit, window)
    return limit


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, with transformers' rope_scaling variants."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: default, " + ", ".join(ROPE_INIT_FUNCTIONS)
        )
    inv_freq, attention_scaling = init(hf_config, "cpu")
    return inv_freq, float(attention_scaling)


def read_safetensors(
    path: Path, dtype: torch.dtype, device: str, skip: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights but those named in `skip`."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in skip:
                    continue
                tensor = f.get_tensor(name)
                # Integer tensors are ids (a draft's d2t map), never weights: kept exact.
                tensors[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    return tensors


def file_blocks(path: Path, hf_config: Any) -> dict[str, GgufBlocks]:
    """The matrices of the GGUF file `path` was converted from whose blocks the kernels
    decode as stored (engine.native.compute.quant.gguf_blocks), by transformers name."""
    source = gguf.source_of(path)
    if source is None or not source.is_file():
        raise QuantizationUnavailableError(
            f"quantization 'gguf' decodes a GGUF file's own blocks; {path} was not converted from one"
        )
    rows = gguf.quantized_rows(source, KERNEL_TYPES, hf_config.to_dict())
    return {name: GgufBlocks(qtype, data) for name, qtype, data in rows}


def load_weights(model: DecoderLM, tensors: dict[str, torch.Tensor | GgufBlocks]) -> None:
    """Assemble the fused projections from HF weight names (GGUF blocks stay blocks, the
    embedding lookup reads their dequantized values)."""
    arch = model.arch

    def take(name: str) -> Any:
        if name not in tensors:
            raise KeyError(f"checkpoint lacks weight {name!r}")
        return tensors.pop(name)

    def maybe(name: str) -> Any:
        return tensors.pop(name, None)

    embedding = take("model.embed_tokens.weight")
    model.embed_tokens = embedding
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        p = f"model.layers.{i}."
        layer.input_layernorm.weight = take(p + "input_layernorm.weight")
        layer.post_attention_layernorm.weight = take(p + "post_attention_layernorm.weight")
        attn = layer.self_attn
        q_w = map_rows(
            take(p + "self_attn.q_proj.weight"), lambda w: permute_heads(w, arch.num_heads, arch.head_dim)
        )
        k_w = map_rows(
            take(p + "self_attn.k_proj.weight"), lambda w: permute_heads(w, arch.num_kv_heads, arch.head_dim)
        )
        v_w = take(p + "self_attn.v_proj.weight")
        qkv_bias = None
        if arch.qkv_bias:
            q_b = permute_heads(take(p + "self_attn.q_proj.bias"), arch.num_heads, arch.head_dim)
            k_b = permute_heads(take(p + "self_attn.k_proj.bias"), arch.num_kv_heads, arch.head_dim)
            qkv_bias = torch.cat([q_b, k_b, take(p + "self_attn.v_proj.bias")])
        attn.qkv_proj.load(cat_rows([q_w, k_w, v_w]), qkv_bias)
        attn.o_proj.load(
            take(p + "self_attn.o_proj.weight"),
            take(p + "self_attn.o_proj.bias") if arch.o_bias else None,
        )
        if arch.qk_norm:
            q_n = permute_heads(take(p + "self_attn.q_norm.weight"), 1, arch.head_dim)
            k_n = permute_heads(take(p + "self_attn.k_norm.weight"), 1, arch.head_dim)
            attn.qk_norm_weight = torch.cat(
                [q_n.expand(arch.num_heads, -1), k_n.expand(arch.num_kv_heads, -1)]
            ).contiguous()
        mlp = layer.mlp
        gate_up_bias = None
        if arch.mlp_bias:
            gate_up_bias = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
        mlp.gate_up_proj.load(
            cat_rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            gate_up_bias,
        )
        down_bias = take(p + "mlp.down_proj.bias") if arch.mlp_bias else None
        mlp.down_proj.load(take(p + "mlp.down_proj.weight"), down_bias)
    model.norm.weight = take("model.norm.weight")
    lm_head = maybe("lm_head.weight")
    d2t = maybe("d2t")
    if arch.draft_vocab_size is not None:
        model.d2t = check_d2t(d2t, arch)
        if lm_head is None:
            raise KeyError("checkpoint lacks weight 'lm_head.weight' (a sub-vocabulary head)")
    elif d2t is not None:
        raise ValueError("checkpoint has a 'd2t' map but its config sets no draft_vocab_size")
    if lm_head is None or (arch.tie_word_embeddings and arch.draft_vocab_size is None):
        # Tied: the LM head is the embedding; it keeps its own packed copy (linear kinds pack).
        lm_head = embedding
    model.lm_head.load(lm_head)
    leftovers = [n for n in tensors if "rotary_emb" not in n]
    if leftovers:
        logger.warning("ignored %d checkpoint tensors, e.g. %s", len(leftovers), leftovers[:3])


def check_d2t(d2t: torch.Tensor | None, arch: ModelArch) -> torch.Tensor:
    """A sub-vocabulary head's map (row i scores token d2t[i]): `draft_vocab_size` distinct
    integer ids of the vocabulary, in a 1-d tensor."""
    if d2t is None:
        raise KeyError(f"checkpoint lacks the 'd2t' map of its draft_vocab_size={arch.draft_vocab_size} head")
    if d2t.is_floating_point() or tuple(d2t.shape) != (arch.draft_vocab_size,):
        raise ValueError(
            f"'d2t' must be {arch.draft_vocab_size} integer token ids (draft_vocab_size), "
            f"got a {d2t.dtype} tensor of shape {tuple(d2t.shape)}"
        )
    d2t = d2t.long()
    low, high = int(d2t.min()), int(d2t.max())
    if low < 0 or high >= arch.vocab_size:
        raise ValueError(
            f"'d2t' holds ids {low} .. {high}, outside the vocabulary of {arch.vocab_size} tokens"
        )
    if len(torch.unique(d2t)) != len(d2t):
        raise ValueError("'d2t' maps two head rows to the same token id")
    return d2t


def resolve_quantization(name: str | None, path: Path, device: str) -> str | None:
    """`auto` on CPU: a GGUF file's own blocks ('gguf'), exact to the file; else int8 where it
    runs, which engine.native.core.precision.gate_weights keeps only if the model's quality gate passes.
    Unquantized elsewhere. Any other name as it is."""
    if name != "auto":
        return name
    if torch.device(device).type != "cpu":
        return None
    if gguf.source_of(path) is not None:
        return "gguf"
    return "int8" if "int8" in available_quantizations(device) else None


def resolve_model_path(name: str) -> Path:
    """A model-zoo name, a local folder, a .gguf file or a hub id, to a local HF-format folder
    (engine.native.loading.model_zoo.resolve_model)."""
    from ragspeed.engine.native.loading.model_zoo import resolve_model

    return Path(resolve_model(name))


def load_for_engine(
    path: Path,
    config: EngineConfig,
    *,
    max_model_len: int | None,
    num_threads: int,
) -> LoadedModel:
    """`path` loaded as `config` asks (device, dtype, quantization) on the engine's thread
    count: the linear kinds keep the count of their load for their products (engine.native.compute.threads)."""
    with cpu_threads(num_threads):
        return load_model(
            path,
            device=config.device,
            dtype=config.dtype,
            quantization=config.quantization,
            max_model_len=max_model_len,
        )


def load_model(
    path: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    quantization: str | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """`max_model_len` (default: the model's limit) sizes the rotation table; it may not exceed
    the model's own limit. The model loads on its exact prefill path (engine.native.core.precision plans
    the faster ones after loading)."""
    from transformers import AutoConfig, GenerationConfig

    path = Path(path)
    hf_config = AutoConfig.from_pretrained(path)
    family = find_family(hf_config)
    arch = arch_from_config(hf_config, family)
    quantization = resolve_quantization(quantization, path, device)
    check_quantization(quantization, device)  # before reading weights: lists what runs here
    torch_dtype = compute_dtype(dtype, device)
    model = DecoderLM(arch, quantization=quantization)
    blocks = file_blocks(path, hf_config) if quantization == "gguf" else {}
    tensors: dict[str, Any] = {**read_safetensors(path, torch_dtype, device, skip=blocks), **blocks}
    load_weights(model, tensors)
    inv_freq, attention_scaling = rope_inv_freq(hf_config, arch.head_dim)
    limit = context_limit(hf_config)
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {limit} tokens")
    max_model_len = max_model_len or limit
    rope_type = dict(getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    rotary = RotaryEmbedding(inv_freq, max_model_len, attention_scaling, device, rope_type)
    eos: Any = None
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        pass
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return LoadedModel(model.eval(), rotary, arch, max_model_len, eos_ids, path, quantization)
