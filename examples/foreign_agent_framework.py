"""An agent from "another framework": no rollfleet base class, just asyncio, a tokenizer and
``LLMServerClient.generate``.

It shows the contract any agent framework needs to share the fleet with rollfleet's own loops:

* send token ids (render the conversation with the tokenizer's chat template yourself);
* use one ``request_id`` for every turn of a trajectory (sticky routing keeps it on one replica
  and its prefix cache), and call ``client.finish_session(request_id)`` when it is done;
* read ``token_ids``, ``log_probs``, ``stop_reason`` and the weight versions from the output.

The agent here is a two-turn "self-check": answer, then re-read the answer and state it again.
This style re-renders the whole conversation as text every turn, as many frameworks do (rollfleet's
``tool_agent`` keeps token ids instead); both run side by side on one fleet.

Run it on a simulated fleet::

    python examples/foreign_agent_framework.py --trajectories 32 --replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Sequence

CHECK_PROMPT = "Check your answer and state the final answer again."


async def self_check_agent(
    client: Any,
    tokenizer: Any,
    question: str,
    *,
    trajectory_id: str,
    max_new_tokens: int = 64,
    temperature: float = 0.7,
) -> dict[str, Any]:
    """One trajectory: question -> answer -> self-check -> final answer."""
    messages = [{"role": "user", "content": question}]
    turns = []
    try:
        for _ in range(2):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
            out = await client.generate(
                trajectory_id,
                prompt_ids=prompt_ids,
                sampling_params={"max_tokens": max_new_tokens, "temperature": temperature},
            )
            answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            turns.append(
                {
                    "prompt_len": len(prompt_ids),
                    "token_ids": list(out.token_ids),
                    "log_probs": out.log_probs,
                    "stop_reason": out.stop_reason,
                    "replica_id": out.extra_fields.get("replica_id"),
                    "min_version": out.extra_fields.get("min_global_steps"),
                    "max_version": out.extra_fields.get("max_global_steps"),
                }
            )
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": CHECK_PROMPT}]
    finally:
        client.finish_session(trajectory_id)
    return {"trajectory_id": trajectory_id, "question": question, "answer": messages[-2]["content"], "turns": turns}


async def run_agents(
    client: Any,
    tokenizer: Any,
    questions: Sequence[str],
    *,
    concurrency: int = 64,
    prefix: str = "foreign",
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Run one self-check trajectory per question, at most ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, q: str) -> dict[str, Any]:
        async with sem:
            return await self_check_agent(client, tokenizer, q, trajectory_id=f"{prefix}-{i}", **kwargs)

    return list(await asyncio.gather(*(one(i, q) for i, q in enumerate(questions))))


async def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=20.0, help="sim engine speed-up")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from rollfleet.config import RollfleetConfig
    from rollfleet.manager import LLMServerManager
    from rollfleet.models import get_model_path

    tokenizer = AutoTokenizer.from_pretrained(get_model_path("tiny"))
    config = RollfleetConfig.model_validate(
        {
            "rollout": {
                "name": "sim",
                "model": "tiny",
                "num_replicas": args.replicas,
                "prompt_length": 512,
                "response_length": 128,
                "sim": {
                    "vocab_size": len(tokenizer),
                    "eos_token_id": tokenizer.eos_token_id,
                    "time_scale": args.time_scale,
                    "mean_response_tokens": 40,
                },
            }
        }
    )
    manager = await LLMServerManager.create(config)
    try:
        client = manager.get_client()
        questions = [f"What is {i} plus {i + 1}?" for i in range(args.trajectories)]
        start = time.perf_counter()
        results = await run_agents(client, tokenizer, questions)
        wall = time.perf_counter() - start
        tokens = sum(len(t["token_ids"]) for r in results for t in r["turns"])
        sticky = sum(len({t["replica_id"] for t in r["turns"]}) == 1 for r in results)
        print(
            f"{len(results)} trajectories in {wall:.2f} s, {tokens} tokens, "
            f"{sticky}/{len(results)} stayed on one replica"
        )
        print(f"example: {results[0]['question']!r} -> {results[0]['answer'][:60]!r}")
        return results
    finally:
        await manager.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
