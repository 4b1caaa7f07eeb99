"""LangChain's own test suite for chat models (`langchain-tests`' `ChatModelIntegrationTests`),
driving `langchain_openai.ChatOpenAI` at a real `ragspeed serve` on the default model, with tool
calling, tool choice, structured output and JSON mode declared: a real client's view of the
OpenAI surface; and the same suite through a proxy (`--engine openai`) in front of it.

The default model is a 135M one: a test that checks what the model chose to say (not the shape
of the response) may fail on its words; those are marked, with the output quoted. The suite
samples at OpenAI's default temperature, with a seed, so that every run draws the same."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from tests.real_model import default_model_cache

# The suite's async tests run on one event loop for the module: ChatOpenAI keeps its async HTTP
# client across instances, and a client made on an earlier test's loop fails on the next ("Event
# loop is closed"). Its sync tests carry the mark too, and pytest-asyncio's warning is silenced.
pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio'"),
]


@pytest.fixture(scope="module", autouse=True)
def ragspeed_servers(tmp_path_factory):
    """The server on the default model, and a proxy (`--engine openai`) in front of it."""
    cache = default_model_cache(tmp_path_factory)
    env = {"RAGSPEED_CACHE_DIR": str(cache)}
    # Start-up distills static embeddings once per cache (about 30 s; minutes on a busy machine).
    with ServerProcess([], env=env, ready_timeout_s=900) as server:
        proxy_args = ["--engine", "openai", "--upstream", server.url, "--no-enable-retrieval"]
        with ServerProcess(proxy_args, env=env, ready_timeout_s=900) as proxy:
            TestRagspeedChatModel.base_url = f"{server.url}/v1"
            TestRagspeedProxyChatModel.base_url = f"{proxy.url}/v1"
            yield


class TestRagspeedChatModel(ChatModelIntegrationTests):
    base_url = ""  # the module's server

    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # stream_usage: an OpenAI-compatible server sends usage in a stream when asked to.
        # A seed: the suite samples at OpenAI's default temperature (1), and a run's draws are
        # then the same in every run. (Greedy, the 135M model loops inside JSON strings until
        # max_tokens in 9 of the suite's structured-output tests.)
        return {
            "seed": 0,
            "model": DEFAULT_MODEL_NAME,
            "api_key": "unused",
            "base_url": self.base_url,
            "stream_usage": True,
        }

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

    # The tests below check what the 135M model chose to say, not the response's shape: each
    # fails on its words (quoted, from a run with seed 0) and passes where it chooses otherwise.

    @pytest.mark.xfail(
        reason="JSON mode asks for an object, not for keys: the model added one, "
        "{'setup': ..., 'punchline': ..., 'json': ...}",
        strict=False,
    )
    def test_json_mode(self, model: ChatOpenAI) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason="tool_choice auto: the model answered in text ('The weather in San Francisco, CA, is "
        "mostly sunny ...') instead of calling get_weather",
        strict=False,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: ChatOpenAI) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="the model called unicode_customer with a name of its own, 'ブッチラゥあくっちゅhttp', "
        "not the one asked for",
        strict=False,
    )
    def test_unicode_tool_call_integration(self, model: ChatOpenAI, **kwargs: Any) -> None:
        super().test_unicode_tool_call_integration(model, **kwargs)


class TestRagspeedProxyChatModel(TestRagspeedChatModel):
    """The same suite through `ragspeed serve --engine openai` in front of the server above:
    the proxy forwards the chat request with every field it does not consume."""
