"""`/v1/prompts`: register, list, get and delete static prompts (admin endpoints; the service
is gateway.prompt_registry)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragspeed.gateway.dependencies import prompt_service
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.security import tenant_cache_salt

router = APIRouter(prefix="/v1/prompts")


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


def _not_found(name: str) -> APIError:
    return APIError(404, f"no prompt named '{name}' is registered", param="name", code="prompt_not_found")


@router.post("", status_code=201)
async def register_prompt(body: RegisterPrompt, service: PromptService = Depends(prompt_service)):
    try:
        prompt = await service.register(body.name, body.text, body.salt)
    except ValueError as exc:  # an invalid name
        raise APIError(400, str(exc), param="name") from None
    return service.describe(prompt)


@router.get("")
async def list_prompts(service: PromptService = Depends(prompt_service)):
    return {"object": "list", "data": [service.describe(p) for p in service.registry.list()]}


@router.get("/{name}")
async def get_prompt(name: str, service: PromptService = Depends(prompt_service)):
    prompt = service.registry.get(name)
    if prompt is None:
        raise _not_found(name)
    return service.describe(prompt)


@router.delete("/{name}")
async def delete_prompt(name: str, service: PromptService = Depends(prompt_service)):
    prompt = await service.remove(name)
    if prompt is None:
        raise _not_found(name)
    return {"object": "prompt.deleted", "name": name, "deleted": True}
