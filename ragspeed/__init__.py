"""ragspeed: a RAG-aware latency middleware behind an OpenAI-compatible API.

The serving packages install beneath this namespace: ``ragspeed.gateway``,
``ragspeed.engine``, ``ragspeed.compression``, ``ragspeed.retrieval`` and
``ragspeed.prompt_cache``. The Python SDK is importable from the top::

    from ragspeed import RagspeedClient, AsyncRagspeedClient
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ragspeed")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["AsyncRagspeedClient", "RagspeedClient", "__version__"]


def __getattr__(name: str) -> object:
    # The SDK imports httpx and the wire models: load it only when asked for, so that
    # `import ragspeed.engine` stays free of the gateway.
    if name in ("RagspeedClient", "AsyncRagspeedClient"):
        from ragspeed.gateway import client

        return getattr(client, name)
    raise AttributeError(f"module 'ragspeed' has no attribute {name!r}")
