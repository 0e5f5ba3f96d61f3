"""What one step of the simulated engine costs: the model behind every simulated second.

A continuous-batching decode step reads the weights once (a fixed cost), does a little work per
running sequence, and reads every running sequence's KV cache (a cost in the tokens of context
they hold: long generations and long prompts make every step slower, which a per-sequence cost
alone cannot express); the step that admits new requests also computes their uncached prompt
tokens. :class:`StepCost` keeps these four constants, and the same arithmetic prices a step in
the engine and a lower bound in a benchmark, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollfleet.config import SimEngineConfig


@dataclass(frozen=True, slots=True)
class StepCost:
    base_ms: float
    per_seq_ms: float
    per_prefill_token_ms: float
    per_context_token_ms: float

    @classmethod
    def of(cls, config: SimEngineConfig) -> "StepCost":
        return cls(
            config.step_base_ms, config.step_per_seq_ms, config.prefill_per_token_ms, config.step_per_context_token_ms
        )

    def step_ms(self, running: int, context_tokens: int = 0, prefill_tokens: int = 0) -> float:
        """One step over ``running`` sequences holding ``context_tokens`` tokens of KV in all,
        admitting requests with ``prefill_tokens`` uncached prompt tokens."""
        return (
            self.base_ms
            + self.per_seq_ms * running
            + self.per_context_token_ms * context_tokens
            + self.per_prefill_token_ms * prefill_tokens
        )

    def decode_ms(self, prompt_tokens: int, output_tokens: int, batch: int = 1) -> float:
        """The steps that generate ``output_tokens`` after a ``prompt_tokens`` prompt, this
        sequence's share of them when it runs in a batch of ``batch`` like it (its context grows
        by one token a step): the price of a trajectory alone (``batch=1``) or at full batch."""
        if output_tokens <= 0:
            return 0.0
        context = output_tokens * prompt_tokens + output_tokens * (output_tokens - 1) / 2  # summed over steps
        fixed = self.base_ms / batch + self.per_seq_ms
        return output_tokens * fixed + self.per_context_token_ms * context

    def prefill_ms(self, tokens: int) -> float:
        return self.per_prefill_token_ms * tokens


__all__ = ["StepCost"]
