"""The remote backend: ragspeed in front of OpenAI-compatible upstreams (vLLM, SGLang, TGI),
with its pooled HTTP/1.1 client and the prefix-affinity routing between upstreams."""
