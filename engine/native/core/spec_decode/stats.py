"""Speculation counters, one set per proposer; exported through `LLMEngine.stats()`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    num_verifications: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps_switched_off: int = 0  # steps the controller ran without drafts (batch, cost)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_verifications += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0

    def as_dict(self, proposer: str) -> dict[str, float]:
        """Flat gauges: the totals, and the same per proposer (`spec_<name>_...`)."""
        values = {
            "draft_tokens": float(self.num_draft_tokens),
            "accepted_tokens": float(self.num_accepted_tokens),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "verifications": float(self.num_verifications),
            "steps_switched_off": float(self.num_steps_switched_off),
        }
        out = {f"spec_{k}": v for k, v in values.items()}
        out.update({f"spec_{proposer}_{k}": v for k, v in values.items()})
        return out
