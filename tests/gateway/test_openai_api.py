"""The official ``openai`` client against the gateway over a simulated fleet."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gateway_support import MODEL, load_codec

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def tokenizer():
    return load_codec().tokenizer


async def test_models_are_listed(oai, stack):
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


async def test_chat_completion_uses_the_chat_template(oai, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    resp = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert resp.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert 1 <= resp.usage.completion_tokens <= 20


async def test_completion_with_text_token_and_batched_prompts(oai):
    text = await oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, logprobs=0)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens <= 8
    lp = text.choices[0].logprobs
    assert len(lp.token_logprobs) == text.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)

    ids = await oai.completions.create(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=5)
    assert ids.usage.prompt_tokens == 4

    batch = await oai.completions.create(model=MODEL, prompt=["one", "two words"], n=2, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


async def test_stream_replays_exactly_the_non_streamed_answer(oai):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = await oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, seed=7, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    text, token_ids, finish, usage, chunks = "", [], None, None, 0
    async for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            token_ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    assert chunks >= 5  # role chunk, several content chunks (8 tokens each), finish, usage
    assert text == whole.choices[0].message.content
    assert token_ids == whole.choices[0].model_extra["token_ids"] and len(token_ids) == 40
    assert finish == "length" and usage.completion_tokens == 40

    parts = []
    async for chunk in await oai.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=20, seed=3, stream=True
    ):
        parts.append(chunk.choices[0].text)
    again = await oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, seed=3)
    assert "".join(parts) == again.choices[0].text


async def test_token_in_token_out(oai, tokenizer):
    prompt_ids = tokenizer.encode("hello world")
    resp = await oai.post(
        "/completions/tokens",
        body={"model": MODEL, "prompt_token_ids": prompt_ids, "max_tokens": 12, "seed": 5, "ignore_eos": True},
        cast_to=httpx.Response,
    )
    body = resp.json()
    assert resp.headers["x-rollfleet-replica"] == body["choices"][0]["replica_id"]
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["token_logprobs"]) == len(choice["weight_versions"]) == 12
    assert choice["min_weight_version"] == choice["max_weight_version"] == choice["weight_versions"][0]
    assert choice["finish_reason"] == "length" and choice["num_resumes"] == 0
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
    }

    # The text route with return_token_ids sends the same ids to the fleet and returns the same tokens.
    text = await oai.completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=12,
        seed=5,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    extra = text.choices[0].model_extra
    assert extra["prompt_token_ids"] == prompt_ids
    assert extra["token_ids"] == choice["token_ids"] and extra["token_logprobs"] == choice["token_logprobs"]
    assert text.choices[0].text == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)


async def test_sessions_stick_to_one_replica_across_turns(oai, http, stack):
    """...and only the caller holding a session (its responses' key) can end it."""
    results_keys: dict[str, str] = {}

    async def session(sid: str, by_user: bool) -> list[str]:
        messages = [{"role": "user", "content": f"session {sid} starts"}]
        replicas = []
        for turn in range(3):
            kwargs = {"user": sid} if by_user else {"extra_headers": {"X-Session-ID": sid}}
            raw = await oai.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=8, **kwargs
            )
            resp = raw.parse()
            replicas.append(raw.headers["x-rollfleet-replica"])
            if turn == 0:
                results_keys[sid] = raw.headers["x-rollfleet-session-key"]  # what ending the session takes
            else:  # to the turn that opened the session only: anyone could send a later one
                assert "x-rollfleet-session-key" not in raw.headers
            if not by_user:
                assert raw.headers["x-rollfleet-session"] == sid
            messages += [
                {"role": "assistant", "content": resp.choices[0].message.content},
                {"role": "user", "content": f"turn {turn}"},
            ]
        return replicas

    before = dict(stack.gateway.service.client.balancer.decisions)
    results = await asyncio.gather(*(session(f"sess-{i}", by_user=i % 2 == 1) for i in range(8)))
    for replicas in results:
        assert len(set(replicas)) == 1, replicas
    decisions = stack.gateway.service.client.balancer.decisions
    assert decisions["sticky"] - before.get("sticky", 0) >= 16  # turns 2 and 3 of 8 sessions
    resp = await http.delete("/v1/sessions/sess-0")  # not the holder: refused
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "X-Rollfleet-Session-Key"
    resp = await http.delete("/v1/sessions/sess-0", headers={"X-Rollfleet-Session-Key": "0" * 32})
    assert resp.status_code == 403
    assert stack.gateway.service.client.balancer.sticky_server("sess-0") is not None  # still there
    resp = await http.delete("/v1/sessions/sess-0", headers={"X-Rollfleet-Session-Key": results_keys["sess-0"]})
    assert resp.status_code == 200
    assert resp.json() == {"session_id": "sess-0", "finished": True, "trajectory_freed": True}
    assert stack.gateway.service.client.balancer.sticky_server("sess-0") is None
    assert stack.gateway.trajectories.get("sess-0") is None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2}
    resp = await http.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "sess-0"})
    assert resp.headers["x-rollfleet-session-key"] == results_keys["sess-0"]  # ended: a new session may take the id


async def test_requests_without_a_session_leave_no_sticky_entries(oai, stack):
    balancer = stack.gateway.service.client.balancer
    before = balancer.get_status()["sticky_sessions"]
    await asyncio.gather(*(oai.completions.create(model=MODEL, prompt="x", max_tokens=2) for _ in range(10)))
    assert balancer.get_status()["sticky_sessions"] == before
