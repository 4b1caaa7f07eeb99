import pytest

from ragspeed.prompt_cache.manager import KVCacheManager
from ragspeed.prompt_cache.registry import PromptRegistry, RegisteredPrompt


def test_register_list_hit_and_remove_with_the_manager():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    registry = PromptRegistry()
    system = list(range(10))
    # The engine prefills the prompt, then pins its blocks and registers them.
    manager.allocate_slots("warm:support", len(system))
    manager.cache_blocks("warm:support", system, len(system))
    manager.free("warm:support")
    pinned = manager.pin(system)
    prompt = registry.register("support", system, pinned, text="You are helpful.")

    assert prompt == RegisteredPrompt("support", tuple(system), (0, 1), "You are helpful.")
    assert prompt.num_tokens == 10 and prompt.hit_count == 0
    assert registry.record_hit("support").hit_count == 1
    assert registry.get("support").hit_count == 1
    assert [p.name for p in registry.list()] == ["support"]
    assert "support" in registry and len(registry) == 1

    removed = registry.remove("support")
    manager.unpin(removed.block_ids)
    assert registry.remove("support") is None and registry.get("support") is None
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_find_prefix_of_prefers_the_longest_prompt_with_the_same_salt():
    registry = PromptRegistry()
    registry.register("short", [1, 2], [])
    registry.register("long", [1, 2, 3], [])
    registry.register("salted", [1, 2, 3, 4], [], cache_salt="t")
    assert registry.find_prefix_of([1, 2, 3, 4, 5]).name == "long"
    assert registry.find_prefix_of([1, 2, 9]).name == "short"
    assert registry.find_prefix_of([1, 2, 3, 4, 5], cache_salt="t").name == "salted"
    assert registry.find_prefix_of([9]) is None


def test_bad_names_and_duplicates_are_refused():
    registry = PromptRegistry()
    registry.register("a-b_c.1", [1], [])
    for bad in ("", ".hidden", "../etc", "a b", "x" * 65):
        with pytest.raises(ValueError, match="name"):
            registry.register(bad, [1], [])
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a-b_c.1", [1], [])
    with pytest.raises(ValueError, match="token_ids"):
        registry.register("empty", [], [])
    with pytest.raises(KeyError):
        registry.record_hit("unknown")
