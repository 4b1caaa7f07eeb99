"""The native engine, in layers; each imports only the layers below it (tests/test_layout.py):

- `core`: a request's life (request, sampling, stop, detokenizer, structured outputs), the
  scheduler and its output, the model runner, the paged KV cache, the prefix and document
  caches, speculative decoding, the precision stage and its quality gate, the engine and its
  factory;
- `loading`: weights from disk (HF safetensors, GGUF), the model zoo and its assets, `--dtype`;
- `models`: the architectures (Llama, Qwen2, Qwen3, Mistral) over the linear kinds;
- `compute`: ragspeed's C kernels, the quantized linears, attention and its metadata, threads,
  and what the CPU has.

Above them all, `engine.backends.native` serves it behind the `EngineClient` seam
(engine.protocol); every layer may read the seam's `engine.protocol` and `engine.config`.
"""
