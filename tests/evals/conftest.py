"""The evaluations run the compressors, the retrieval stack and the gateway on a tiny Llama:
their packages' fixtures."""

from tests.compression.conftest import static_encoder  # noqa: F401  (a fixture, shared)
from tests.gateway.conftest import tiny_model  # noqa: F401  (a fixture, shared)
from tests.retrieval.conftest import embedder  # noqa: F401  (a fixture, shared)
