"""Decoder-only transformer models computed on a flat batch of tokens over a paged KV cache."""
