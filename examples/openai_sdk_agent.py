"""A multi-turn, tool-calling agent written with the ``openai`` package only (no rollfleet import).

rollfleet trains it as it is, through the ``http_agent`` loop: each sample's run gets a base URL
whose session the gateway records token for token. Two ways to plug it in:

* as a callable, in the agent-loop worker's process::

      agent:
        default_agent_loop: http_agent
        http_agent:
          agent: examples/openai_sdk_agent.py:solve

* as a program, one process per sample (it reads ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
  ``ROLLFLEET_SAMPLE`` / ``ROLLFLEET_MODEL`` / ``ROLLFLEET_SAMPLING``, and prints its reward, if
  it computes one, as the last line ``{"reward": x}``)::

        http_agent:
          command: ["{python}", "examples/openai_sdk_agent.py"]

The agent answers the sample's chat prompt; when the model calls a tool it runs it and sends the
result back, for up to ``MAX_TURNS`` model turns. It leaves the reward to the trainer (the
sample's verifiable reward scores what the model wrote), so it returns None.
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace
from typing import Any, Optional

from openai import AsyncOpenAI

MAX_TURNS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "next_numbers",
            "description": "The k integers that follow n, separated by spaces.",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "k": {"type": "integer"}},
                "required": ["n", "k"],
            },
        },
    }
]


def next_numbers(n: int, k: int = 4) -> str:
    return " ".join(str(n + 1 + i) for i in range(max(0, min(int(k), 16))))


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        if name == "next_numbers":
            return next_numbers(int(args["n"]), int(args.get("k", 4)))
        return f"unknown tool {name!r}"
    except Exception as exc:  # a bad call is the model's mistake: tell it, do not crash the run
        return f"error: {type(exc).__name__}: {exc}"


async def solve(run: Any) -> Optional[float]:
    """One episode: ``run`` has ``base_url``, ``api_key``, ``model``, ``sample`` and ``sampling``."""
    client = AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=2)
    messages: list[dict[str, Any]] = [dict(m) for m in run.sample["raw_prompt"]]
    settings = {k: run.sampling[k] for k in ("temperature", "top_p") if run.sampling.get(k) is not None}
    budget = int(run.sampling.get("max_tokens") or 64)  # tokens the model may still write
    try:
        for _ in range(MAX_TURNS):
            if budget <= 0:
                break
            out = await client.chat.completions.create(
                model=run.model, messages=messages, tools=TOOLS, max_tokens=budget, **settings
            )
            budget -= out.usage.completion_tokens if out.usage else budget
            message = out.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    return None


def main() -> None:
    run = SimpleNamespace(
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),
        model=os.environ.get("ROLLFLEET_MODEL", "tiny"),
        sample=json.loads(os.environ["ROLLFLEET_SAMPLE"]),
        sampling=json.loads(os.environ.get("ROLLFLEET_SAMPLING", "{}")),
    )
    reward = asyncio.run(solve(run))
    if reward is not None:
        print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
