"""Scripted conversations for the simulated engine: make a model "say" chosen turns.

``LLMServerManager.script_responses(fn)`` lets a test decide every response's tokens. A
multi-turn agent needs the *n*-th assistant turn of a conversation to say the *n*-th scripted text,
also when a turn is resumed after an abort (the resumed request's prompt then ends with the
tokens generated so far). :class:`ScriptedTurns` does this from the prompt alone, so it is
stateless and picklable (it runs inside every replica actor): the turn number is the number of
assistant generation prompts in the prompt, and the tokens already generated are what follows the
last one.
"""

from __future__ import annotations

from typing import Any, Sequence

from rollfleet.types import SamplingParams


class ScriptedTurns:
    """A response script: turn *k* of every conversation answers ``turns[k]`` (the last repeats).

    Args:
        turns: token ids of each assistant turn (end each with the end-of-turn token).
        header: token ids of the generation prompt that opens an assistant turn.
        base_headers: headers already in the initial prompts (0 for a single user message).
    """

    def __init__(self, turns: Sequence[Sequence[int]], header: Sequence[int], base_headers: int = 0) -> None:
        if not turns or any(len(t) == 0 for t in turns):
            raise ValueError("every scripted turn needs at least one token")
        self.turns = [list(t) for t in turns]
        self.header = list(header)
        self.base_headers = base_headers

    @classmethod
    def from_texts(cls, tokenizer: Any, texts: Sequence[str], **kwargs: Any) -> "ScriptedTurns":
        """Turns from text: each text tokenised and closed with the tokenizer's eos token."""
        user = [{"role": "user", "content": "?"}]
        with_prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(user, tokenize=False)
        header = tokenizer.encode(with_prompt[len(without) :], add_special_tokens=False)
        turns = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
        return cls(turns, header, **kwargs)

    def _header_positions(self, ids: list[int]) -> list[int]:
        h, n = self.header, len(self.header)
        return [i + n for i in range(len(ids) - n + 1) if ids[i : i + n] == h]

    def __call__(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams) -> list[int]:
        ends = self._header_positions(list(prompt_ids))
        turn = max(0, len(ends) - 1 - self.base_headers)
        done = len(prompt_ids) - ends[-1] if ends else 0  # tokens of this turn generated before a resume
        script = self.turns[min(turn, len(self.turns) - 1)]
        rest = script[done:]
        return rest if rest else script[-1:]


__all__ = ["ScriptedTurns"]
