"""Named static prompts: pure bookkeeping of what is registered and pinned.

A *registered prompt* is a static system prompt the engine has prefilled once and pinned
(`KVCacheManager.pin`); its blocks are never evicted while registered. The registry only records
name -> token ids, pinned block ids and hit counts; the engine does the prefill, the pin and the
unpin (`remove` hands back the entry so the caller can unpin its blocks).

Names are also file names of persisted prefixes (store.py), so they are restricted to
`[A-Za-z0-9_.-]`, 1 to 64 characters, not starting with a dot.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


def validate_prompt_name(name: str) -> str:
    """Return `name` if it is a valid prompt name; raise ValueError naming the parameter."""
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"name {name!r} is invalid: use 1-64 characters of A-Z a-z 0-9 _ . -, not starting with '.'"
        )
    return name


@dataclass(frozen=True)
class RegisteredPrompt:
    """One registered static prompt. `hit_count` counts requests that used it."""

    name: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # pinned blocks, as returned by KVCacheManager.pin
    text: str = ""
    cache_salt: str | None = None
    hit_count: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class PromptRegistry:
    """name -> RegisteredPrompt; one per engine, built in its lifespan."""

    def __init__(self) -> None:
        self._prompts: dict[str, RegisteredPrompt] = {}

    def register(
        self,
        name: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        text: str = "",
        cache_salt: str | None = None,
    ) -> RegisteredPrompt:
        """Add a prompt. Raises ValueError if `name` is invalid or already registered (remove
        it first, so its blocks get unpinned) or `token_ids` is empty."""
        validate_prompt_name(name)
        if name in self._prompts:
            raise ValueError(f"name {name!r} is already registered; remove it first")
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        prompt = RegisteredPrompt(
            name=name,
            token_ids=tuple(token_ids),
            block_ids=tuple(block_ids),
            text=text,
            cache_salt=cache_salt,
        )
        self._prompts[name] = prompt
        return prompt

    def get(self, name: str) -> RegisteredPrompt | None:
        return self._prompts.get(name)

    def list(self) -> list[RegisteredPrompt]:
        """All registered prompts, by name."""
        return [self._prompts[name] for name in sorted(self._prompts)]

    def remove(self, name: str) -> RegisteredPrompt | None:
        """Forget a prompt and return it (the caller unpins `block_ids`); None if unknown."""
        return self._prompts.pop(name, None)

    def set_block_ids(self, name: str, block_ids: Sequence[int]) -> RegisteredPrompt:
        """Record the blocks pinned for a registered prompt (e.g. once it is prefilled again
        after a restart); KeyError if it is not registered."""
        prompt = replace(self._prompts[name], block_ids=tuple(block_ids))
        self._prompts[name] = prompt
        return prompt

    def record_hit(self, name: str) -> RegisteredPrompt:
        """Count one request that used the prompt; KeyError if it is not registered."""
        prompt = replace(self._prompts[name], hit_count=self._prompts[name].hit_count + 1)
        self._prompts[name] = prompt
        return prompt

    def find_prefix_of(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> RegisteredPrompt | None:
        """The longest registered prompt (same salt) that `token_ids` starts with, or None."""
        best: RegisteredPrompt | None = None
        for prompt in self._prompts.values():
            if prompt.cache_salt != cache_salt or len(prompt.token_ids) > len(token_ids):
                continue
            if tuple(token_ids[: prompt.num_tokens]) == prompt.token_ids:
                if best is None or prompt.num_tokens > best.num_tokens:
                    best = prompt
        return best

    def __len__(self) -> int:
        return len(self._prompts)

    def __contains__(self, name: object) -> bool:
        return name in self._prompts
