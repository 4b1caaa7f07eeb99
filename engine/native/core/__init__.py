"""The native engine's core: requests, the scheduler, the model runner, the KV cache, the
prefix and document caches, speculation and the precision stage. It imports the layers below
(loading, models, compute), never the other way round."""
