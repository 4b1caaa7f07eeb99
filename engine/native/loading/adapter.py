"""LoRA adapters shipped with the package, merged into their base model's weights once.

An adapter file is a safetensors file holding, for each adapted weight `W` of the base model
(its name in model.safetensors, `[out, in]`), two tensors `<name>.lora_a` `[rank, in]` and
`<name>.lora_b` `[out, rank]`, and in its metadata the `scale` (alpha / rank). The merged weight
is `W + scale * B @ A`, computed in fp32: the served model is a plain checkpoint, with nothing
of the adapter left at run time. ragspeed.training.block_attention writes such files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "model.safetensors"
STAMP_FILE = "ragspeed_adapter.json"  # written last: the merge is complete and of these inputs
LORA_A, LORA_B = ".lora_a", ".lora_b"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_adapter(path: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """The adapter's (A, B) pairs by weight name, and its scale; ValueError for a malformed file."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        names = list(f.keys())
        tensors = {name: f.get_tensor(name) for name in names}
    try:
        scale = float(metadata["scale"])
    except (KeyError, ValueError):
        raise ValueError(f"adapter {path} has no numeric 'scale' in its metadata") from None
    pairs = {}
    for name in names:
        if name.endswith(LORA_A):
            weight = name[: -len(LORA_A)]
            b = tensors.get(weight + LORA_B)
            if b is None:
                raise ValueError(f"adapter {path}: {name} has no {weight + LORA_B}")
            pairs[weight] = (tensors[name], b)
    if not pairs or len(pairs) * 2 != len(names):
        raise ValueError(f"adapter {path} holds unpaired or no LoRA tensors")
    return pairs, scale


def merge_adapter(base_dir: Path, adapter: Path, out_dir: Path) -> Path:
    """`out_dir`: the base model's folder with the adapter merged into its weights (replaced
    whole, atomically). Every adapted weight must exist in the base with the adapter's shape."""
    pairs, scale = read_adapter(adapter)
    weights = load_file(str(base_dir / WEIGHTS_FILE))
    for name, (a, b) in pairs.items():
        base = weights.get(name)
        if base is None or tuple(base.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter {adapter.name}: {name} does not fit the base model {base_dir}")
        merged = base.float() + scale * (b.float() @ a.float())
        weights[name] = merged.to(base.dtype).contiguous()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in base_dir.iterdir():
        if item.is_file() and item.name != WEIGHTS_FILE and not item.name.startswith("ragspeed_"):
            shutil.copy2(item, tmp / item.name)
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / STAMP_FILE).write_text(json.dumps(merge_stamp(base_dir, adapter), indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def merge_stamp(base_dir: Path, adapter: Path) -> dict[str, object]:
    """What the merge was made of: the adapter's bytes, and the base weights' file by its size
    and modification time (hashing half a gigabyte at every start would cost a second)."""
    base = (base_dir / WEIGHTS_FILE).stat()
    return {
        "adapter_sha256": file_sha256(adapter),
        "base_weights": {
            "path": str(base_dir / WEIGHTS_FILE),
            "size": base.st_size,
            "mtime_ns": base.st_mtime_ns,
        },
    }


def merged_is_current(out_dir: Path, base_dir: Path, adapter: Path) -> bool:
    stamp = out_dir / STAMP_FILE
    if not stamp.is_file() or not (out_dir / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads(stamp.read_text()) == merge_stamp(base_dir, adapter)
    except (OSError, ValueError):
        return False
