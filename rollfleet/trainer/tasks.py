"""Built-in toy tasks with verifiable rewards, small enough to learn from scratch on a CPU.

``count``: the prompt is a run of consecutive numbers ("Count: 3 4 5"); the answer continues it
("6 7 8 9"). The reward has two parts: the share of answer characters that are digits or spaces
(a random model scores about 1%, so GRPO groups carry signal from the first step) and the share
of expected numbers produced in order (what the model can only get by reading the prompt). A
randomly initialised tiny model learns the first part within tens of steps and starts on the
second; the mean reward climbs from ~0.01.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Iterator

from rollfleet.reward import register_reward


@register_reward("count_continuation")
def count_continuation(solution_str: str, ground_truth: Any, **_: Any) -> float:
    text = solution_str.strip()
    if not text:
        return 0.0
    digits = sum(ch.isdigit() or ch == " " for ch in text) / len(text)
    expected = str(ground_truth or "").split()
    got = text.split()
    matched = 0
    for want, have in zip(expected, got):
        if want != have:
            break
        matched += 1
    order = matched / len(expected) if expected else 0.0
    return 0.5 * digits + 0.5 * order


@dataclass
class TaskStream:
    """An endless, seeded stream of samples with a resumable position."""

    name: str
    seed: int = 0
    position: int = 0
    prompt_tokens: int = 128  # ``synthetic``: the length of every prompt

    def sample_at(self, index: int) -> dict[str, Any]:
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        if self.name == "count":
            start = rng.randrange(0, 60)
            shown = rng.randrange(3, 6)
            prompt = " ".join(str(start + i) for i in range(shown))
            answer = " ".join(str(start + shown + i) for i in range(4))
            return {
                "raw_prompt": [{"role": "user", "content": f"Count: {prompt}"}],
                "reward": {"name": "rollfleet.trainer.tasks:count_continuation", "ground_truth": answer},
                "task_index": index,
            }
        if self.name == "synthetic":
            # A plan's workload: prompts of exactly ``prompt_tokens`` token ids, no text, a reward
            # given outright (what a plan measures does not depend on it; decoding would cost).
            ids = [rng.randrange(16, 1_000) for _ in range(self.prompt_tokens)]  # in every vocabulary
            return {"prompt_ids": ids, "reward": {"score": 0.0}, "task_index": index}
        raise ValueError(f"unknown task '{self.name}'; built-in tasks: ['count', 'synthetic']")

    def next(self) -> dict[str, Any]:
        sample = self.sample_at(self.position)
        self.position += 1
        return sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield self.next()


def make_task(name: str, seed: int = 0, position: int = 0, prompt_tokens: int = 128) -> TaskStream:
    stream = TaskStream(name, seed, position, prompt_tokens)
    stream.sample_at(0)  # fail early on an unknown name
    return stream


__all__ = ["count_continuation", "TaskStream", "make_task"]
