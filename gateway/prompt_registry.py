"""Registered static prompts: the service behind `/v1/prompts` (gateway.routes.prompts).

A *registered prompt* is a named static system prompt. Registering renders it through the chat
template exactly as a request with only that system message starts (`gateway.prompt`), prefills
it once and pins its full KV blocks in the native engine, so they are never evicted while it is
registered; it is also saved to `prompt_cache_dir` (its record: name, text and salt; then its
KV, token ids, model and tokenizer fingerprint; `engine.native.core.prefix_store`) and restored at start-up,
so a restart does not pay the prefill again. A prompt whose saved KV cannot be used (corrupt,
from another model, the pool full) is never dropped: it is registered from its record at once
and prefilled again in the background, while requests naming it prefill it themselves. The
engine does the pinning, exporting and restoring through its
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
    from ragspeed.engine.native.core.prefix_store import PrefixStore, SavedPrompt

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
        self._prefilling: asyncio.Task | None = None  # prompts restored without their KV

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
        """After the engine started: open the store and register every saved prompt, with its
        KV restored where that is usable; the others are prefilled again in the background."""
        cache = self.cache
        if cache is None or self.directory is None:
            return
        from ragspeed.engine.native.core.prefix_store import PrefixStore

        self._store = PrefixStore(self.directory, await cache.fingerprint())
        again = []
        for saved in await asyncio.to_thread(self._store.load_all):
            record = saved.record
            token_ids = static_prefix_ids(self._engine.tokenizer, record.text)
            if not token_ids:
                continue
            block_ids = await self._restore(saved, token_ids)
            self.registry.register(
                record.name, token_ids, block_ids or (), text=record.text, cache_salt=record.cache_salt
            )
            if block_ids is None:
                again.append(record.name)
            else:
                logger.info(
                    "restored prompt %s: %d tokens, %d pinned",
                    record.name,
                    len(token_ids),
                    len(block_ids) * cache.block_size,
                )
        if again:
            self._prefilling = asyncio.create_task(self._prefill_again(again))

    async def _restore(self, saved: SavedPrompt, token_ids: tuple[int, ...]) -> tuple[int, ...] | None:
        """The pinned blocks of a saved prompt's KV, or None where it must be prefilled again."""
        name, cache = saved.record.name, self.cache
        assert cache is not None  # start() restores only with a pinning engine
        if saved.kv is None:
            logger.warning("saved prompt %s has no usable KV: prefilling it again", name)
            return None
        if saved.token_ids != token_ids:
            logger.warning("saved prompt %s renders to other tokens now: prefilling it again", name)
            return None
        try:
            block_ids = await cache.restore(token_ids, saved.kv, saved.record.cache_salt)
        except ValueError as error:
            logger.warning("saved prompt %s not restored (%s): prefilling it again", name, error)
            return None
        if block_ids is None:
            logger.warning("saved prompt %s not restored, the KV pool is full: prefilling it again", name)
        return block_ids

    async def _prefill_again(self, names: list[str]) -> None:
        for name in names:
            async with self._lock:
                prompt = self.registry.get(name)
                if prompt is None or prompt.block_ids:  # deleted, or registered anew, meanwhile
                    continue
                try:
                    block_ids = await self._pin_and_save(
                        name, prompt.token_ids, prompt.text, prompt.cache_salt
                    )
                except Exception as error:  # the prompt stays registered, served by its text
                    logger.warning("prefilling saved prompt %s again failed: %s", name, error)
                    continue
                pinned = self.registry.set_block_ids(name, block_ids)
                logger.info(
                    "prefilled saved prompt %s again: %d tokens pinned", name, self.pinned_tokens(pinned)
                )

    async def _pin_and_save(
        self, name: str, token_ids: tuple[int, ...], text: str, cache_salt: str | None
    ) -> tuple[int, ...]:
        """Prefill and pin `token_ids`; save their KV when there is a store. The pinned blocks."""
        cache, store = self.cache, self._store
        assert cache is not None  # called only with a pinning engine
        block_ids = await cache.pin(token_ids, cache_salt)
        if store is not None and block_ids:
            from ragspeed.engine.native.core.prefix_store import PinnedPrefix

            try:
                kv = await cache.export(block_ids)
                prefix = PinnedPrefix(name, token_ids, block_ids, text, cache_salt)
                await asyncio.to_thread(store.save, prefix, kv)
            except BaseException:
                await cache.unpin(block_ids)
                raise
        return block_ids

    async def close(self) -> None:
        """Stop prefilling saved prompts again (the server is stopping)."""
        if self._prefilling is not None:
            self._prefilling.cancel()
            await asyncio.gather(self._prefilling, return_exceptions=True)
            self._prefilling = None

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
                if self._store is not None:  # the record first: a kill from here on keeps the prompt
                    from ragspeed.prompt_cache.store import PromptRecord

                    await asyncio.to_thread(self._store.save_record, PromptRecord(name, text, cache_salt))
                try:
                    block_ids = await self._pin_and_save(name, token_ids, text, cache_salt)
                except BaseException:
                    if self._store is not None:
                        await asyncio.to_thread(self._store.delete, name)
                    raise
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

    def with_registered_prompt(self, segments: Segments, name: str) -> Segments:
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
