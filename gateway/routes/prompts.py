"""`/v1/prompts`: register, list, get and delete static prompts (admin endpoints; the service
is gateway.prompt_registry)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import Field

from ragspeed.gateway.dependencies import prompt_service
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.security import TenantSalt

router = APIRouter(prefix="/v1/prompts")


class RegisterPrompt(TenantSalt):
    name: str = Field(..., min_length=1, max_length=64)
    text: str = Field(..., min_length=1)


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
