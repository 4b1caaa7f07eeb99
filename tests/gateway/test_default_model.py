"""`ragspeed serve` with no model flag serves the real default model; the README's Nobel request
through the official openai client is answered with the name from the document, and /v1/models
names the decode path it chose."""

from __future__ import annotations

import openai

from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from tests.real_model import NOBEL_DOCUMENT, NOBEL_MESSAGES, default_model_cache


def test_serve_without_flags_answers_the_readme_question(tmp_path_factory):
    cache = default_model_cache(tmp_path_factory)  # converted here once; the server reads the manifest
    with ServerProcess(
        [],  # `ragspeed serve`, nothing else (the launcher adds host and port)
        env={"RAGSPEED_CACHE_DIR": str(cache)},
    ) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        completion = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=NOBEL_MESSAGES,
            max_tokens=32,
            temperature=0,
            extra_body={"documents": [NOBEL_DOCUMENT]},
        )
        (served,) = client.models.list().data
    answer = completion.choices[0].message.content
    print(f"\nanswer: {answer!r}")
    assert completion.model == DEFAULT_MODEL_NAME
    assert "Röntgen" in answer
    # The path serve chose with no flags: the GGUF's own blocks, reported beside the model.
    weights = served.model_extra["ragspeed"]["weights"]
    assert weights["quantization"] == "gguf" and "Q4_1 blocks" in weights["decode"], weights
