"""LangChain's own test suite for chat models (`langchain-tests`' `ChatModelIntegrationTests`),
driving `langchain_openai.ChatOpenAI` at a real `ragspeed serve` on the default model, with tool
calling, tool choice, structured output and JSON mode declared: a real client's view of the
OpenAI surface.

The default model is a 135M one: a test that checks what the model chose to say (not the shape
of the response) may fail on its words; those are marked with the output quoted."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.model_zoo import DEFAULT_MODEL_NAME
from tests.real_model import default_model_cache


@pytest.fixture(scope="module")
def ragspeed_url(tmp_path_factory):
    cache = default_model_cache(tmp_path_factory)
    # Start-up distills static embeddings once per cache (about 30 s; minutes on a busy machine).
    with ServerProcess([], env={"RAGSPEED_CACHE_DIR": str(cache)}, ready_timeout_s=900) as server:
        yield f"{server.url}/v1"


class TestRagspeedChatModel(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": DEFAULT_MODEL_NAME, "api_key": "unused"}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @pytest.fixture
    def model(self, request: Any, ragspeed_url: str) -> ChatOpenAI:
        extra_init_params = getattr(request, "param", None) or {}
        return ChatOpenAI(
            **{
                **self.standard_chat_model_params,
                **self.chat_model_params,
                "base_url": ragspeed_url,
                **extra_init_params,
            }
        )
