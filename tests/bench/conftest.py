"""The benchmarks load real servers: the gateway tests' tiny model serves them too."""

from tests.gateway.conftest import tiny_model  # noqa: F401  (a fixture, shared)
