"""Seeded random-weight tiny checkpoints of each supported family, saved in HF format."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 384
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {}),
}
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention reads keys and values through block tables.",
    "Größe, naïve café: ünïcödé text — 東京 and 😀 emoji.",
]


def build_tokenizer(vocab_size: int = VOCAB_SIZE - 32):
    """A byte-level BPE tokenizer: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def build_tiny_checkpoint(family: str, path: Path, *, seed: int = 0, **overrides) -> Path:
    """2 layers, hidden 64, 4 heads / 2 KV heads; weights scaled so logits have clear margins."""
    import transformers

    config_name, extra = FAMILY_CONFIGS[family]
    sizes = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=family in ("qwen2", "qwen3"),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        initializer_range=0.2,
    )
    config = getattr(transformers, config_name)(**{**sizes, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Biases (Qwen2) start at zero; give them values so the loader is tested on them.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def build_sub_vocab_draft(source: Path, path: Path, d2t, *, num_layers: int | None = None) -> Path:
    """`source` as a draft with a sub-vocabulary head: head row i is `source`'s LM-head row
    d2t[i] (so its argmax over the rows is `source`'s argmax over those tokens), the `d2t` map
    stored beside the weights; `num_layers`: keep only the first ones."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    d2t = torch.tensor(list(d2t), dtype=torch.long)
    weights["lm_head.weight"] = head[d2t].contiguous()
    weights["d2t"] = d2t
    num_layers = num_layers or config["num_hidden_layers"]
    weights = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=False, draft_vocab_size=len(d2t))
    (path / "config.json").write_text(json.dumps(config))
    return path
