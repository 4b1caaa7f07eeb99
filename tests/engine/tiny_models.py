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
