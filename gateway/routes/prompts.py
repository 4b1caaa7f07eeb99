"""The static prompt registry: `/v1/prompts` (admin endpoints) and the service behind them.

A *registered prompt* is a named static system prompt. Registering renders it through the chat
template exactly as a request with only that system message starts (`gateway.prompt`), prefills
it once and pins its full KV blocks in the native engine, so they are never evicted while it is
registered; it is also saved to `prompt_cache_dir` (KV, token ids, model and tokenizer
fingerprint; `engine.prefix_store`) and restored at start-up, so a restart does not pay the
prefill again. A chat request names it with `ragspeed.system_prompt`: its text becomes the
request's static system prompt. Such a request must not carry a system message of its own (400:
two system prompts would be ambiguous, and silently merging them would change the prefix).

Tenants: the blocks are pinned under one cache salt. `tenant` pins them for that tenant's API
keys (their requests carry `tenant_cache_salt(tenant)`); `cache_salt` for clients that send
that salt themselves (auth off); neither: requests without a salt. A request of another tenant
may still name the prompt (its text is substituted) but never hits those blocks: tenants never
share a block (docs/architecture.md, contract 3).

Engines without a prefix cache (transformers, openai, native with caching off): the registry
still works by text substitution; nothing is pinned (`pinned_tokens: 0`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt import Segments, assemble_prompt
from ragspeed.gateway.security import tenant_cache_salt
from ragspeed.prompt_cache.registry import PromptRegistry, RegisteredPrompt, validate_prompt_name

logger = logging.getLogger("ragspeed.gateway")

router = APIRouter(prefix="/v1/prompts")


def static_prefix_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """The leading tokens every request with this system prompt shares (chat template applied)."""
    prompt = assemble_prompt(tokenizer, Segments(text, (), (), ""), ())
    return prompt.token_ids[: prompt.num_static_tokens]


class PromptService:
    """Registry + pins + persistence of one engine; built in the lifespan."""

    def __init__(self, engine: Any, directory: str | None):
        self.engine = engine
        self.directory = directory
        self.registry = PromptRegistry()
        self._store: Any = None  # engine.prefix_store.PrefixStore, once the engine is up
        self._lock = asyncio.Lock()

    @property
    def pins(self) -> bool:
        """Whether this engine pins blocks (the native engine with prefix caching on)."""
        return callable(getattr(self.engine, "call", None)) and bool(
            getattr(self.engine.config, "enable_prefix_caching", False))

    def pinned_tokens(self, prompt: RegisteredPrompt) -> int:
        return len(prompt.block_ids) * self.engine.config.block_size if prompt.block_ids else 0

    def describe(self, prompt: RegisteredPrompt) -> dict[str, Any]:
        return {"object": "prompt", "name": prompt.name, "text": prompt.text,
                "num_tokens": prompt.num_tokens, "pinned_tokens": self.pinned_tokens(prompt),
                "hit_count": prompt.hit_count, "salted": prompt.cache_salt is not None}

    async def start(self) -> None:
        """After the engine started: open the store and restore every saved prefix."""
        if not self.pins or self.directory is None:
            return
        from ragspeed.engine.prefix_store import PrefixStore, engine_fingerprint, restore_prefix

        fingerprint = await self.engine.call(engine_fingerprint)
        self._store = PrefixStore(self.directory, fingerprint)
        for saved, kv in await asyncio.to_thread(self._store.load_all):
            if saved.name in self.registry:
                continue
            block_ids = await self.engine.call(
                lambda e, s=saved, k=kv: restore_prefix(e, s.token_ids, k, s.cache_salt))
            if block_ids is None:
                logger.warning("saved prompt %s not restored: the KV pool is full", saved.name)
                continue
            self.registry.register(saved.name, saved.token_ids, block_ids, text=saved.text,
                                   cache_salt=saved.cache_salt)
            logger.info("restored prompt %s: %d tokens, %d pinned", saved.name,
                        len(saved.token_ids), len(block_ids) * self.engine.config.block_size)

    async def register(self, name: str, text: str, cache_salt: str | None) -> RegisteredPrompt:
        validate_prompt_name(name)
        async with self._lock:
            if name in self.registry:
                raise APIError(400, f"a prompt named '{name}' is already registered; delete it first",
                               param="name", code="prompt_exists")
            token_ids = static_prefix_ids(self.engine.tokenizer, text)
            if not token_ids:
                raise APIError(400, "text renders to no tokens", param="text")
            block_ids: tuple[int, ...] = ()
            if self.pins:
                from ragspeed.engine.prefix_store import PinnedPrefix, export_kv, pin_prefix

                await self.engine.warm(token_ids, cache_salt)
                block_ids = await self.engine.call(lambda e: pin_prefix(e, token_ids, cache_salt))
                if self._store is not None and block_ids:
                    kv = await self.engine.call(lambda e: export_kv(e, block_ids))
                    prefix = PinnedPrefix(name, token_ids, block_ids, text, cache_salt)
                    await asyncio.to_thread(self._store.save, prefix, kv)
            return self.registry.register(name, token_ids, block_ids, text=text,
                                          cache_salt=cache_salt)

    async def remove(self, name: str) -> RegisteredPrompt | None:
        async with self._lock:
            prompt = self.registry.remove(name)
            if prompt is None:
                return None
            if prompt.block_ids:
                from ragspeed.engine.prefix_store import unpin_prefix

                await self.engine.call(lambda e: unpin_prefix(e, prompt.block_ids))
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
            raise APIError(400, "ragspeed.system_prompt names a registered prompt, so the request "
                                "must not also carry a system message", param="ragspeed.system_prompt",
                           code="two_system_prompts")
        prompt = self.use(name)
        if prompt is None:
            raise APIError(400, f"no prompt named '{name}' is registered", param="ragspeed.system_prompt",
                           code="prompt_not_found")
        return replace(segments, static_system_prompt=prompt.text)


class RegisterPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=64)
    text: str = Field(..., min_length=1)
    tenant: str | None = Field(None, min_length=1, description="Pin for this tenant's API keys.")
    cache_salt: str | None = Field(None, min_length=1, description="Pin for requests with this salt.")

    @model_validator(mode="after")
    def _one_salt(self) -> RegisterPrompt:
        if self.tenant is not None and self.cache_salt is not None:
            raise ValueError("give either tenant or cache_salt, not both")
        return self

    @property
    def salt(self) -> str | None:
        return tenant_cache_salt(self.tenant) if self.tenant is not None else self.cache_salt


def _service(request: Request) -> PromptService:
    state = request.app.state
    if not getattr(state, "engine_ready", False):
        raise APIError(503, "the engine is still loading; retry shortly", code="engine_not_ready",
                       headers={"Retry-After": "2"})
    return state.prompts


def _not_found(name: str) -> APIError:
    return APIError(404, f"no prompt named '{name}' is registered", param="name",
                    code="prompt_not_found")


@router.post("", status_code=201)
async def register_prompt(body: RegisterPrompt, request: Request):
    service = _service(request)
    try:
        prompt = await service.register(body.name, body.text, body.salt)
    except ValueError as exc:  # an invalid name
        raise APIError(400, str(exc), param="name") from None
    return service.describe(prompt)


@router.get("")
async def list_prompts(request: Request):
    service = _service(request)
    return {"object": "list", "data": [service.describe(p) for p in service.registry.list()]}


@router.get("/{name}")
async def get_prompt(name: str, request: Request):
    service = _service(request)
    prompt = service.registry.get(name)
    if prompt is None:
        raise _not_found(name)
    return service.describe(prompt)


@router.delete("/{name}")
async def delete_prompt(name: str, request: Request):
    service = _service(request)
    prompt = await service.remove(name)
    if prompt is None:
        raise _not_found(name)
    return {"object": "prompt.deleted", "name": name, "deleted": True}

