"""Gateway test fixtures: real servers (a tiny seeded Llama served by `ragspeed serve`) for the
end-to-end tests, and the fake engine for the in-process ones (`tests.gateway.inprocess`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import resolve_model

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with random weights and the demo model's tokenizer and chat template."""
    demo = Path(resolve_model("ragspeed-demo"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (demo / name).is_file():
            shutil.copy(demo / name, out_dir / name)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def transformers_server(tiny_model):
    with ServerProcess(
        ["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny"]
    ) as server:
        yield server


@pytest.fixture(scope="session")
def gateway_server(transformers_server, tiny_model):
    """A ragspeed gateway whose engine is the `openai` backend, forwarding to a second ragspeed."""
    with ServerProcess(
        [
            "--engine",
            "openai",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny-via-gateway",
            "--upstream",
            transformers_server.url,
            "--upstream-model",
            "tiny",
        ]
    ) as server:
        yield server


# ---------------------------------------------------------------------- in-process (fake engine)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def demo_tokenizer():
    """The demo model's tokenizer and chat template: what the fake engine tokenizes with (the
    tiny Llama above has the same, so token counts match the subprocess tests')."""
    return AutoTokenizer.from_pretrained(resolve_model("ragspeed-demo"))


@pytest.fixture
def fake(monkeypatch, demo_tokenizer):
    """Backend "fake" registered for this test: `serve(fake_settings(...))` builds its engines."""
    from tests.gateway.fake_engine import install

    return install(monkeypatch, demo_tokenizer)


@pytest.fixture
def assembled_documents(monkeypatch) -> list[tuple]:
    """The documents each request's prompt is assembled from, in order: the gateway's
    `assemble_prompt` watched, its result unchanged."""
    from ragspeed.gateway import prepare

    seen: list[tuple] = []
    real_assemble = prepare.assemble_prompt

    def assemble_prompt(tokenizer, segments, documents, **kwargs):
        seen.append(tuple(documents))
        return real_assemble(tokenizer, segments, documents, **kwargs)

    monkeypatch.setattr(prepare, "assemble_prompt", assemble_prompt)
    return seen
