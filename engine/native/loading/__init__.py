"""Loading: a model's weights from disk into the model classes (HF safetensors, GGUF), the
model zoo (every `--model` value to a local folder) and its assets, and what `--dtype` names.
It imports models and compute, never core."""
