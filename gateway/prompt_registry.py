"""Registered static prompts: the service behind `/v1/prompts` (gateway.routes.prompts).

A *registered prompt* is a named static system prompt. Registering renders it through the chat
template exactly as a request with only that system message starts (`gateway.prompt`), prefills
it once and pins its full KV blocks in the native engine, so they are never evicted while it is
registered; it is also saved to `prompt_cache_dir` (KV, token ids, model and tokenizer
fingerprint; `engine.prefix_store`) and restored at start-up, so a restart does not pay the
prefill again. The engine does the pinning, exporting and restoring through its
`PrefixCacheControl` (`engine.protocol`). A chat request names it with `ragspeed.system_prompt`: its text becomes the
request's static system prompt. Such a request must not carry a system message of its own (400:
two system prompts would be ambiguous, and silently merging them would change the prefix).

Tenants: the blocks are pinned under one cache salt. `tenant` pins them for that tenant's API
keys (their requests carry `tenant_cache_salt(tenant)`); `cache_salt` for clients that send
that salt themselves (auth off); neither: requests without a salt. A request of another tenant
may still name the prompt (its text is substituted) but never hits those blocks: tenants never
share a block (docs/architecture.md, contract 3).

Engines without a prefix cache (`prefix_cache()` is None: transformers, openai, vllm, native
with caching off): the registry still works by text substitution; nothing is pinned
(`pinned_tokens: 0`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ragspeed.engine.protocol import EngineClient, PrefixCacheControl
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt import Segments, assemble_prompt
from ragspeed.prompt_cache.registry import PromptRegistry, RegisteredPrompt, validate_prompt_name

if TYPE_CHECKING:  # the store is torch's half; imported when a directory is set
    from ragspeed.engine.prefix_store import PrefixStore

logger = logging.getLogger("ragspeed.gateway")


def static_prefix_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """The leading tokens every request with this system prompt shares (chat template applied)."""
    prompt = assemble_prompt(tokenizer, Segments(text, (), (), ""), ())
    return prompt.token_ids[: prompt.num_static_tokens]


class PromptService:
    """Registry + pins + persistence over one engine's `PrefixCacheControl`; built with the app."""

    def __init__(self, engine: EngineClient, directory: str | None):
        self._engine = engine  # for its tokenizer, there once the engine has started
        self.cache: PrefixCacheControl | None = engine.prefix_cache()
        self.directory = directory
        self.registry = PromptRegistry()
        self._store: PrefixStore | None = None  # once the engine is up and a directory is set
        self._lock = asyncio.Lock()

    @property
    def pins(self) -> bool:
        """Whether this engine pins blocks (the native engine with prefix caching on)."""
        return self.cache is not None

    def pinned_tokens(self, prompt: RegisteredPrompt) -> int:
        if self.cache is None or not prompt.block_ids:
            return 0
        return len(prompt.block_ids) * self.cache.block_size

    def describe(self, prompt: RegisteredPrompt) -> dict[str, Any]:
        return {
            "object": "prompt",
            "name": prompt.name,
            "text": prompt.text,
            "num_tokens": prompt.num_tokens,
            "pinned_tokens": self.pinned_tokens(prompt),
            "hit_count": prompt.hit_count,
            "salted": prompt.cache_salt is not None,
        }

    async def start(self) -> None:
        """After the engine started: open the store and restore every saved prefix."""
        cache = self.cache
        if cache is None or self.directory is None:
            return
        from ragspeed.engine.prefix_store import PrefixStore

        self._store = PrefixStore(self.directory, await cache.fingerprint())
        for saved, kv in await asyncio.to_thread(self._store.load_all):
            if saved.name in self.registry:
                continue
            block_ids = await cache.restore(saved.token_ids, kv, saved.cache_salt)
            if block_ids is None:
                logger.warning("saved prompt %s not restored: the KV pool is full", saved.name)
                continue
            self.registry.register(
                saved.name, saved.token_ids, block_ids, text=saved.text, cache_salt=saved.cache_salt
            )
            logger.info(
                "restored prompt %s: %d tokens, %d pinned",
                saved.name,
                len(saved.token_ids),
                len(block_ids) * cache.block_size,
            )

    async def register(self, name: str, text: str, cache_salt: str | None) -> RegisteredPrompt:
        validate_prompt_name(name)
        text = text.strip()  # as a system message is (gateway.prompt): inline and by name agree
        if not text:
            raise APIError(400, "text is only white space", param="text")
        async with self._lock:
            if name in self.registry:
                raise APIError(
                    400,
                    f"a prompt named '{name}' is already registered; delete it first",
                    param="name",
                    code="prompt_exists",
                )
            token_ids = static_prefix_ids(self._engine.tokenizer, text)
            if not token_ids:
                raise APIError(400, "text renders to no tokens", param="text")
            block_ids: tuple[int, ...] = ()
            if self.cache is not None:
                block_ids = await self.cache.pin(token_ids, cache_salt)
                if self._store is not None and block_ids:
                    from ragspeed.engine.prefix_store import PinnedPrefix

                    kv = await self.cache.export(block_ids)
                    prefix = PinnedPrefix(name, token_ids, block_ids, text, cache_salt)
                    await asyncio.to_thread(self._store.save, prefix, kv)
            return self.registry.register(name, token_ids, block_ids, text=text, cache_salt=cache_salt)

    async def remove(self, name: str) -> RegisteredPrompt | None:
        async with self._lock:
            prompt = self.registry.remove(name)
            if prompt is None:
                return None
            if prompt.block_ids and self.cache is not None:
                await self.cache.unpin(prompt.block_ids)
            if self._store is not None:
                await asyncio.to_thread(self._store.delete, name)
            return prompt

    def use(self, name: str) -> RegisteredPrompt | None:
        """The prompt a request names, counting the hit; None if not registered."""
        if name not in self.registry:
            return None
        return self.registry.record_hit(name)

    def apply(self, segments: Segments, name: str) -> Segments:
        """The request's segments with the named prompt as its static system prompt."""
        if segments.static_system_prompt:
            raise APIError(
                400,
                "ragspeed.system_prompt names a registered prompt, so the request "
                "must not also carry a system message",
                param="ragspeed.system_prompt",
                code="two_system_prompts",
            )
        prompt = self.use(name)
        if prompt is None:
            raise APIError(
                400,
                f"no prompt named '{name}' is registered",
                param="ragspeed.system_prompt",
                code="prompt_not_found",
            )
        return replace(segments, static_system_prompt=prompt.text)
