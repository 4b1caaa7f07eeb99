"""ragspeed prompt_cache: hash-chained prefix caching, pure Python (no torch).

`KVCacheManager` (manager.py) is the engine's door to the block pool (block_pool.py) and its
chained block hashes (hashing.py); `PromptRegistry` (registry.py) names pinned static prompts;
store.py persists pinned prefixes atomically, taking the tensor writer and reader as callables.
"""

from ragspeed.prompt_cache.block_pool import Block, BlockPool
from ragspeed.prompt_cache.hashing import BlockHash, hash_block_tokens, hash_request_blocks
from ragspeed.prompt_cache.manager import KVCacheManager
from ragspeed.prompt_cache.registry import PromptRegistry, RegisteredPrompt
from ragspeed.prompt_cache.stats import PrefixCacheStats
from ragspeed.prompt_cache.store import LoadedPrefix, load_prefix, save_prefix

__all__ = [
    "Block",
    "BlockHash",
    "BlockPool",
    "KVCacheManager",
    "LoadedPrefix",
    "PrefixCacheStats",
    "PromptRegistry",
    "RegisteredPrompt",
    "hash_block_tokens",
    "hash_request_blocks",
    "load_prefix",
    "save_prefix",
]
