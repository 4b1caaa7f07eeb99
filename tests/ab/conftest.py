"""The A/B runner replays against real servers: the gateway tests' tiny model and server."""

from tests.gateway.conftest import tiny_model, transformers_server  # noqa: F401  (fixtures, shared)
