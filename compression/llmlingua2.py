"""LLMLingua-2 (token classification: keep or drop each word) through the `llmlingua` package,
offline, from a local model folder.

Two things in llmlingua 0.2.2 stand in the way offline, and are set aside here rather than
patched in the package:
- `PromptCompressor.__init__` calls `tiktoken.encoding_for_model("gpt-3.5-turbo")`, which
  downloads a file. We build the object without `__init__` and give it, as its "OpenAI
  tokenizer", the caller's target tokenizer, so llmlingua's token counts and budgets are in the
  target model's tokens.
- its word merging knows only two model families by name (`bert-base-multilingual-cased`:
  WordPiece "##" pieces; `xlm-roberta-large`: SentencePiece "▁" pieces). We pick the family
  from the local tokenizer's kind, not from the path.
LLMLingua-2 drops words, so it may cut inside sentences: it is the token-level contender, not
the default.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ragspeed.compression.base import (
    CompressedDocument,
    CompressionError,
    CompressionResult,
    Document,
    Tokenizer,
    as_documents,
    count_tokens,
)
from ragspeed.compression.budget import Budget

_WORDPIECE_FAMILY = "bert-base-multilingual-cased"
_SENTENCEPIECE_FAMILY = "xlm-roberta-large"


class _TargetTokens:
    """What llmlingua calls its `oai_tokenizer`: only `.encode(text)` is used."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return [0] * count_tokens(self.tokenizer, text)


def _family(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    if any(piece.startswith("##") for piece in vocab):
        return _WORDPIECE_FAMILY
    if any(piece.startswith("▁") for piece in vocab):
        return _SENTENCEPIECE_FAMILY
    raise CompressionError(
        "llmlingua2 needs a WordPiece (BERT) or SentencePiece (XLM-R) token-classification model",
        "model_path",
    )


class LLMLingua2Compressor:
    name = "llmlingua2"

    def __init__(
        self, model_path: str | Path | None = None, *, device: str = "cpu", max_batch_size: int = 50
    ):
        if model_path is None:
            raise CompressionError(
                "llmlingua2 needs model_path: a local LLMLingua-2 model folder", "model_path"
            )
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise CompressionError(
                f"no LLMLingua-2 model at {path} (expected a folder with config.json, weights and "
                "a tokenizer, e.g. a local copy of microsoft/llmlingua-2-xlm-roberta-large-meetingbank)",
                "model_path",
            )
        try:
            from llmlingua import PromptCompressor  # an extra: only this compressor needs it
        except ImportError as error:
            raise CompressionError(
                "llmlingua2 needs the llmlingua package: pip install 'ragspeed[llmlingua]'"
            ) from error

        compressor = PromptCompressor.__new__(PromptCompressor)  # skips the tiktoken download
        compressor.model_name = str(path)
        compressor.use_llmlingua2 = True
        compressor.retrieval_model = None
        compressor.retrieval_model_name = None
        compressor.open_api_config = {}
        compressor.cache_bos_num = 10
        compressor.prefix_bos_num = 100
        compressor.oai_tokenizer = None  # set per call to the target tokenizer
        compressor.load_model(str(path), device, {"trust_remote_code": False})
        compressor.model_name = _family(compressor.tokenizer)  # what its word merging keys on
        compressor.init_llmlingua2(max_batch_size=max_batch_size)
        self._compressor = compressor
        self._lock = threading.Lock()  # oai_tokenizer is per call state on a shared object

    def compress(
        self,
        question: str,
        documents: Sequence[Document],
        budget: Budget,
    ) -> CompressionResult:
        start = time.perf_counter()
        tokenizer = budget.tokenizer
        docs = as_documents(documents)
        num_tokens = [count_tokens(tokenizer, d.text) for d in docs]
        num_original = sum(num_tokens)
        protected_doc_tokens = sum(n for d, n in zip(docs, num_tokens) if d.protected)
        num_budget = budget.document_tokens(num_original, protected_doc_tokens)
        free = [i for i, d in enumerate(docs) if not d.protected and d.text.strip()]
        free_tokens = sum(num_tokens[i] for i in free)
        texts = {i: docs[i].text for i in range(len(docs))}
        if free and free_tokens > num_budget:
            with self._lock:
                self._compressor.oai_tokenizer = _TargetTokens(tokenizer)
                out = self._compressor.compress_prompt_llmlingua2(
                    [docs[i].text for i in free],
                    rate=max(num_budget, 0) / free_tokens,
                    force_tokens=["\n", ".", "?", "!"],
                    chunk_end_tokens=[".", "\n"],
                )
            for i, text in zip(free, out["compressed_prompt_list"]):
                texts[i] = text
        kept = []
        for i, doc in enumerate(docs):
            text = texts[i].strip() if not doc.protected else doc.text
            if not text and not doc.protected:
                continue
            n = num_tokens[i] if doc.protected else count_tokens(tokenizer, text)
            kept_doc = doc if text == doc.text else dataclasses.replace(doc, text=text)
            kept.append(CompressedDocument(kept_doc, (text,), (), num_tokens[i], n))
        return CompressionResult(
            method=self.name,
            documents=tuple(kept),
            num_original_tokens=num_original,
            num_compressed_tokens=sum(d.num_kept_tokens for d in kept),
            elapsed_s=time.perf_counter() - start,
            budget_tokens=num_budget,
            num_dropped_documents=len(docs) - len(kept),
        )
