"""Helpers for the agent-loop tests: sim configs on the tiny tokenizer, in-process fleets.

(Not in conftest.py: a test module importing ``conftest`` by name could get another directory's.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollfleet.client import LLMServerClient
from rollfleet.config import RollfleetConfig
from rollfleet.server.local import LocalHandle
from rollfleet.server.replica import Replica


def sim_config(
    tokenizer: Any, *, rollout: dict | None = None, agent: dict | None = None, sim: dict | None = None
) -> RollfleetConfig:
    """A sim-engine config whose token ids are the tiny tokenizer's (decodable)."""
    sim_section = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "time_scale": 100.0,
        "mean_response_tokens": 40,
        "response_sigma": 0.5,
        **(sim or {}),
    }
    rollout_section = {
        "name": "sim",
        "model": "tiny",
        "num_replicas": 2,
        "prompt_length": 256,
        "response_length": 256,
        "routing": {"load_refresh_interval_s": 0.1},
        "retry": {"max_attempts": 50, "initial_backoff_s": 0.01, "max_backoff_s": 0.1},
        "sim": sim_section,
        **(rollout or {}),
    }
    return RollfleetConfig.model_validate({"rollout": rollout_section, "agent": agent or {"num_workers": 2}})


class LocalFleet:
    """Sim replicas in this event loop (no Ray) behind a real client."""

    def __init__(self, config: RollfleetConfig, num_replicas: int = 1, client_cls: type = LLMServerClient) -> None:
        self.config = config
        self.replicas = [Replica(f"r{i}", config.rollout, i) for i in range(num_replicas)]
        self.client = client_cls(config.rollout, servers={r.replica_id: LocalHandle(r) for r in self.replicas})

    async def start(self) -> "LocalFleet":
        for r in self.replicas:
            await r.start(version=0)
        return self

    def script(self, script: Any) -> None:
        for r in self.replicas:
            r.engine.script_responses(script)

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.shutdown()


QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def lookup(key: str) -> str:
    """Look a key up."""
    return f"value-of-{key}"


def broken(x: str) -> str:
    raise RuntimeError("the tool broke")


async def hangs(x: str) -> str:
    await asyncio.sleep(30)
    return "never"


#: Two tools per turn for two turns (one raises, one times out), then the answer.
THREE_TURNS = [
    'I will use tools. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>',
    '<tool_call>\n{"name": "broken", "arguments": {"x": "1"}}\n</tool_call>'
    '<tool_call>\n{"name": "hangs", "arguments": {"x": "1"}}\n</tool_call>',
    "The answer is 5.",
]


def mask_runs(mask) -> list[tuple[int, int]]:
    """(start, end) of the runs of 1s in a response mask: one run per model turn."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


class Recorder:
    """Wraps a client and records every generate call and finish_session."""

    def __init__(self, client):
        self.client = client
        self.calls: list[tuple[str, list[int], dict, object]] = []
        self.finished: list[str] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        out = await self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params), out))
        return out

    def finish_session(self, request_id):
        self.finished.append(request_id)
        self.client.finish_session(request_id)
