"""Schemathesis against the gateway's own OpenAPI schema, served by a real `ragspeed serve`.

Every operation, a bounded number of generated requests each (valid ones, then invalid ones); no 5xx,
only the statuses of contract 6 (docs/architecture.md), and every error in the OpenAI error
shape. The server's context is kept short so that any generated `max_tokens` finishes quickly.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from ragspeed.bench.launcher import ServerProcess

# Contract 6 plus 403 (admin paths) and 405 (a method a path does not have); an operation may
# document more (201 for a created collection, ...).
ALLOWED_STATUSES = {200, 400, 401, 403, 404, 405, 413, 429, 503, 504}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    args = [
        "--engine",
        "transformers",
        "--model",
        str(tiny_model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "64",
        "--default-max-tokens",
        "4",
        "--request-timeout-s",
        "10",
        "--collections-dir",
        str(tmp_path_factory.mktemp("fuzz-collections")),
        "--prompt-cache-dir",
        str(tmp_path_factory.mktemp("fuzz-prompts")),
        "--log-level",
        "warning",
    ]
    with ServerProcess(args) as server:
        yield server


def contract_statuses(ctx, response, case) -> None:
    """Only contract 6's statuses or those the operation documents, and errors in the OpenAI shape."""
    status = response.status_code
    documented = {int(code) for code in case.operation.definition.raw.get("responses", {}) if code.isdigit()}
    assert status in ALLOWED_STATUSES | documented, (
        f"status {status} for {case.method} {case.path}: {response.text[:300]}"
    )
    if status >= 400 and status != 405:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


# schemathesis' own pytest plugin (`from_fixture`) does not run under pytest 9, so each operation's
# strategy is driven by hypothesis here: the same cases, the same checks.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_survives_generated_requests(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /healthz",
        "GET /metrics",
    }
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not (operation.body or operation.query):
            continue  # nothing to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=10,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            response = case.call(base_url=fuzz_server.url, timeout=30)
            case.validate_response(response, checks=[not_a_server_error, contract_statuses])

        check()


def test_the_server_is_still_healthy_after_fuzzing(fuzz_server):
    import httpx

    assert httpx.get(f"{fuzz_server.url}/healthz", timeout=10).status_code == 200
    log = fuzz_server.log_tail(1_000_000)
    assert "Traceback" not in log and "unhandled error" not in log
