"""The evaluations run the compressors and the retrieval stack: their packages' fixtures."""

from tests.compression.conftest import static_encoder  # noqa: F401  (a fixture, shared)
from tests.retrieval.conftest import embedder  # noqa: F401  (a fixture, shared)
