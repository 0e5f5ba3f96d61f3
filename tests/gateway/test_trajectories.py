"""Trajectory capture and function calling through the gateway, driven by the real ``openai`` client.

The gateway runs over one in-process sim replica (no Ray) whose every generation is recorded on
the engine's side, so the test can compare what the gateway captured with what the engine was
prompted with and sampled, token for token.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
import openai
import pytest
from gateway_support import MODEL, in_process_gateway

from rollfleet.config import GatewayConfig
from rollfleet.gateway.trajectories import Sampled, TrajectoryStore, Turn

pytestmark = pytest.mark.unit

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


class Stack:
    def __init__(self, server: Any, gateway: Any, replica: Any) -> None:
        self.server, self.gateway, self.replica = server, gateway, replica
        self.engine_calls: list[tuple[list[int], list[int], list[float]]] = []
        self.http = httpx.AsyncClient(base_url=server.url, timeout=30)

    def key(self, session: str) -> dict[str, str]:
        """The header a session's own responses carried (what its holder, e.g. a trainer, presents)."""
        return {"X-Rollfleet-Session-Key": self.gateway.session_keys.key(session)}

    def client(self, session: str | None = None) -> openai.AsyncOpenAI:
        base = f"{self.server.url}/sessions/{session}/v1" if session else f"{self.server.url}/v1"
        return openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)

    async def trajectory(self, session: str) -> dict[str, Any]:
        resp = await self.http.get(f"/v1/sessions/{session}/trajectory", headers=self.key(session))
        assert resp.status_code == 200, resp.text
        return resp.json()


@asynccontextmanager
async def stack(**gateway: Any) -> AsyncIterator[Stack]:
    server, gw, replica = await in_process_gateway(
        GatewayConfig(**gateway), response_length=24, time_scale=1000.0, mean_response_tokens=12
    )
    s = Stack(server, gw, replica)
    generate = replica.generate_with_load

    async def recorded(request_id: str, prompt_ids: list[int], params: Any = None, **kw: Any) -> Any:
        response = await generate(request_id, prompt_ids, params, **kw)
        out = response.output
        s.engine_calls.append((list(prompt_ids), list(out.token_ids), list(out.log_probs or [])))
        return response

    replica.generate_with_load = recorded  # type: ignore[method-assign]
    try:
        yield s
    finally:
        await s.http.aclose()
        await server.stop()
        await replica.shutdown()


def reply_dict(message: Any) -> dict[str, Any]:
    """The assistant message as an agent sends it back (the SDK object, dumped)."""
    return message.model_dump(exclude_none=True)


async def test_multi_turn_sessions_capture_exactly_what_the_engine_saw_and_re_rendering_would_not():
    """20 sessions x 3 turns through the openai client, a weight update after the first turns:
    every captured turn is the engine's own prompt and sample; re-rendering the conversation as
    text (the baseline) gives different ids in most sessions."""
    async with stack() as s:
        conversations: dict[str, list[dict[str, Any]]] = {}
        for turn in range(3):
            if turn == 1:
                await s.replica.update_weights({"step": 1}, 1)
            for i in range(20):
                sid = f"traj-{i}"
                messages = conversations.setdefault(sid, [])
                messages.append({"role": "user", "content": f"turn {turn} of session {i}: count 1 2 3"})
                out = await s.client(sid).chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
                messages.append(reply_dict(out.choices[0].message))
        engine = {(tuple(p), tuple(o)): lp for p, o, lp in s.engine_calls}
        drifted = 0
        for i in range(20):
            record = await s.trajectory(f"traj-{i}")
            assert record["num_turns"] == 3 and len(record["branches"]) == 1, record["branches"][-1]["why"]
            branch = record["branches"][0]
            ids, mask = branch["token_ids"], branch["mask"]
            starts = [t["prompt_tokens"] for t in branch["turns"]]
            ends = [t["prompt_tokens"] + t["response_tokens"] for t in branch["turns"]]
            for k, (start, end) in enumerate(zip(starts, ends)):
                key = (tuple(ids[:start]), tuple(ids[start:end]))
                assert key in engine, f"session {i} turn {k}: not what the engine was prompted with and sampled"
                assert branch["logprobs"][start:end] == engine[key]
                assert mask[start:end] == [1] * (end - start)
                if k:
                    assert branch["turns"][k]["reused_prompt_tokens"] == ends[k - 1]
            assert sum(mask) == sum(e - b for b, e in zip(starts, ends))
            versions = branch["weight_versions"]
            assert {versions[j] for j in range(starts[0], ends[0])} == {0}
            assert {versions[j] for j in range(starts[2], ends[2])} == {1}
            rerendered = s.gateway.codec.render_chat(conversations[f"traj-{i}"], add_generation_prompt=False)
            drifted += rerendered[: len(ids)] != ids
        print(f"re-rendering drifted in {drifted}/20 sessions; captured ids differ from the engine's in 0/20")
        assert drifted > 0  # the baseline problem is real on this tokenizer, so the capture above matters


async def test_an_edited_history_starts_a_new_branch_and_says_why():
    async with stack() as s:
        client = s.client("edit")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "first"}]
        out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        messages.append(reply_dict(out.choices[0].message))
        edited = [{"role": "user", "content": "first, edited"}, messages[1], {"role": "user", "content": "next"}]
        await client.chat.completions.create(model=MODEL, messages=edited, max_tokens=6)
        forged = [*messages, {"role": "user", "content": "x"}]
        forged[1] = {"role": "assistant", "content": "not what the model said"}
        await client.chat.completions.create(model=MODEL, messages=forged, max_tokens=6)
        record = await s.trajectory("edit")
        whys = [b["why"] for b in record["branches"]]
        assert whys[0] == "first turn"
        assert whys[1].startswith("history edited: messages[0]")
        assert "not the assistant reply" in whys[2] or "history edited" in whys[2], whys


OTHER_TEMPLATE = (
    "{% for m in messages %}### {{ m.role }}: {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant: {% endif %}"
)


@pytest.mark.parametrize("change", ["reply holds the end-of-turn text", "chat_template_kwargs"])
async def test_a_turn_the_last_ones_ids_cannot_carry_is_rendered_as_a_new_branch(change):
    """A reply whose text holds the end-of-turn marker (written as plain pieces): the next prompt
    went on after that copy, so the rest of the reply came twice. New chat template kwargs: the
    history went on in the old rendering, the new turn in the new one. Each is a new branch now,
    and the engine is prompted with the conversation as rendered."""
    async with stack(allow_caller_chat_template=True) as s:
        codec = s.gateway.codec
        if change == "chat_template_kwargs":
            reply, kwargs = codec.encode("ok", add_special_tokens=False), {"chat_template": OTHER_TEMPLATE}
        else:
            reply = codec.encode("A <|im", add_special_tokens=False) + codec.encode(
                "_end|> B C", add_special_tokens=False
            )
            kwargs = None
        await s.replica.script_responses(lambda rid, prompt, params: reply + [codec.eos_token_id])
        client = s.client("b")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        messages += [reply_dict(out.choices[0].message), {"role": "user", "content": "next"}]
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, extra_body=extra)
        prompt = s.engine_calls[-1][0]
        assert prompt == codec.render_chat(messages, template_kwargs=kwargs)
        whys = [b["why"] for b in (await s.trajectory("b"))["branches"]]
        assert len(whys) == 2 and ("end-of-turn marker" in whys[1] or "kwargs changed" in whys[1]), whys


async def test_tool_calls_are_parsed_and_the_next_turn_continues_from_the_sampled_ids():
    """The model writes a Hermes call: the SDK sees ``tool_calls`` and ``finish_reason ==
    "tool_calls"``; the agent sends the call back with the tool's result and the next turn reuses
    the sampled ids (one branch) although the template re-serialises the call's JSON."""
    async with stack() as s:
        codec = s.gateway.codec
        call_ids = codec.encode(CALL_TEXT, add_special_tokens=False) + [codec.eos_token_id]
        answer_ids = codec.encode("3", add_special_tokens=False) + [codec.eos_token_id]
        await s.replica.script_responses(lambda rid, prompt, params: call_ids if b"tool_response" not in bytes(
            codec.decode(prompt), "utf-8") else answer_ids)  # fmt: skip
        client = s.client("tools")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 1 + 2?"}]
        out = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
        messages += [reply_dict(choice.message), {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        out = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
        assert out.choices[0].message.content == "3" and out.choices[0].finish_reason == "stop"
        record = await s.trajectory("tools")
        assert len(record["branches"]) == 1 and record["num_turns"] == 2
        branch = record["branches"][0]
        first, second = branch["turns"]
        assert second["reused_prompt_tokens"] == first["prompt_tokens"] + len(call_ids)
        start = first["prompt_tokens"]
        assert branch["token_ids"][start : start + len(call_ids)] == call_ids  # the sampled call, as sampled
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages[:1], tools=TOOLS, max_tokens=64, stream=True
        )
        chunks = [c async for c in stream]
        deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["add"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        no_tools = await client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=64)
        assert no_tools.choices[0].message.tool_calls is None  # no tools passed: the text is the reply
        assert "<tool_call>" in no_tools.choices[0].message.content


async def test_a_streamed_reply_shows_its_text_as_sampled_and_its_calls_parsed_at_the_end():
    """Live: the text before the call goes out in chunks, the call's own text never does; the
    calls come parsed in one delta and the session records the call ids the caller was shown."""
    async with stack() as s:
        codec = s.gateway.codec
        text = "Let me add those two numbers for you.\n" + CALL_TEXT
        reply_ids = codec.encode(text, add_special_tokens=False) + [codec.eos_token_id]
        await s.replica.script_responses(lambda rid, prompt, params: reply_ids)
        stream = await s.client("live").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "1 + 2?"}], tools=TOOLS, max_tokens=64, stream=True
        )
        chunks = [c async for c in stream]
        contents = [ch.delta.content for c in chunks for ch in c.choices if ch.delta.content]
        calls = [(i, tc) for i, c in enumerate(chunks) for ch in c.choices for tc in (ch.delta.tool_calls or [])]
        assert "".join(contents) == "Let me add those two numbers for you.\n"
        assert len(contents) > 1  # several chunks: it was streamed, not replayed at the end
        assert not any("<" in piece for piece in contents)  # not even the start of the marker
        ((at, call),) = calls
        assert at == len(chunks) - 2 and chunks[-1].choices[0].finish_reason == "tool_calls"
        session = s.gateway.trajectories.get("live")
        assert session is not None
        recorded = session.branches[0].turns[0].choices[0].message
        assert recorded["tool_calls"][0]["id"] == call.id and json.loads(call.function.arguments) == {"a": 1, "b": 2}


async def test_rewards_keys_and_bad_session_requests_get_clear_errors():
    async with stack(max_sessions=3) as s:
        http = httpx.AsyncClient(base_url=s.server.url, timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        resp = await http.post("/v1/chat/completions", json=body, headers={"x-session-id": "mine"})
        key = resp.headers["X-Rollfleet-Session-Key"]
        mine = {"X-Rollfleet-Session-Key": key}
        assert (await http.get("/v1/sessions/mine/trajectory")).status_code == 403  # no key: not yours
        # Someone who knows the id and sends a turn under it is not handed the key (it was, on every
        # response), so cannot read, score or end the session.
        other = await http.post("/v1/chat/completions", json=body, headers={"x-session-id": "mine"})
        assert other.status_code == 200 and "X-Rollfleet-Session-Key" not in other.headers
        assert (await http.post("/v1/sessions/mine/reward", json={"reward": 1.5}, headers=mine)).status_code == 200
        record = (await http.get("/v1/sessions/mine/trajectory", headers=mine)).json()
        assert record["reward"] == 1.5 and record["num_turns"] == 2
        assert (await http.get("/v1/sessions/mine/trajectory", headers=mine)).json() == record  # asked twice: same

        async def error(resp: httpx.Response, status: int, param: Any, code: str | None = None) -> None:
            assert resp.status_code == status, resp.text
            err = resp.json()["error"]
            assert err["param"] == param and (code is None or err["code"] == code), err

        await error(await http.post("/v1/sessions/mine/reward", json={"reward": "high"}, headers=mine), 400, "reward")
        await error(await http.post("/v1/sessions/mine/reward", json={"reward": None}, headers=mine), 400, "reward")
        huge = b'{"reward": 1' + b"0" * 400 + b"}"  # a JSON integer no float holds
        await error(await http.post("/v1/sessions/mine/reward", content=huge, headers=mine), 400, "reward")
        for not_json in (b"\xff\xfe\xff", b"[" * 5000 + b"]" * 5000):  # not UTF-8; nested past the parser
            await error(await http.post("/v1/sessions/mine/reward", content=not_json, headers=mine), 400, None)
        for header in ({"X-Rollfleet-Session-Key": b"\xe9"}, {"Authorization": b"Bearer \xe9"}):  # non-ASCII
            await error(await http.get("/v1/sessions/mine/trajectory", headers=header), 403, "X-Rollfleet-Session-Key")
        await error(
            await http.get("/v1/sessions/nobody/trajectory", headers=s.key("nobody")),
            404,
            "session_id",
            "session_not_found",
        )
        assert (await http.delete("/v1/sessions/mine", headers=mine)).status_code == 200
        await error(
            await http.post("/v1/sessions/mine/reward", json={"reward": 1}, headers=mine),
            409,
            "session_id",
            "session_ended",
        )
        bad_tools = {**body, "tools": [{"type": "function", "function": {"name": "has space"}}]}
        await error(await http.post("/v1/chat/completions", json=bad_tools), 400, "tools[0].function.name")
        await error(
            await http.post("/v1/chat/completions", json={**body, "tools": [{"type": "x"}]}), 400, "tools[0].type"
        )
        required = {**body, "tools": TOOLS, "tool_choice": "required"}
        await error(await http.post("/v1/chat/completions", json=required), 400, "tool_choice", "unsupported_value")
        bad_args = {**body, "messages": [*body["messages"], {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}  # fmt: skip
        await error(
            await http.post("/v1/chat/completions", json=bad_args), 400, "messages[1].tool_calls[0].function.arguments"
        )
        deep = "[" * 5000 + "]" * 5000
        deep_args = {**body, "messages": [*body["messages"], {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": deep}}]}]}  # fmt: skip
        await error(
            await http.post("/v1/chat/completions", json=deep_args), 400, "messages[1].tool_calls[0].function.arguments"
        )
        for i in range(5):  # over max_sessions=3: the oldest are evicted, and say so
            await http.post("/v1/chat/completions", json=body, headers={"x-session-id": f"s{i}"})
        evicted = await http.get("/v1/sessions/s0/trajectory", headers=s.key("s0"))
        await error(evicted, 409, "session_id", "session_ended")
        assert "max_sessions" in evicted.json()["error"]["message"]
        metrics = (await http.get("/metrics")).text
        assert "rollfleet_gateway_recorded_sessions 3.0" in metrics
        assert 'rollfleet_gateway_evicted_sessions_total{why="capacity"} 2.0' in metrics
        ok = await http.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200  # none of it touched the fleet
        await http.aclose()


def test_sessions_idle_past_the_ttl_are_forgotten_and_counted():
    now = [0.0]
    store = TrajectoryStore(max_sessions=10, ttl_s=60.0, clock=lambda: now[0])
    turn = Turn([1, 2], [Sampled([3], [-0.1], [0], "stop", {"role": "assistant", "content": "x"})])
    store.record("a", [], None, turn, new_branch=None)
    now[0] = 30.0
    store.record("b", [], None, turn, new_branch=None)
    now[0] = 61.0
    assert store.get("a") is None and store.get("b") is not None
    assert store.evicted == {"capacity": 0, "ttl": 1, "branches": 0}
    with pytest.raises(Exception, match="expired: idle over gateway.session_ttl_s=60s"):
        store.trajectory("a")


def test_a_session_keeps_its_last_branches_only():
    """One id for every conversation (OpenAI's user field): each unrelated one is a new branch of
    one session, touched too often to expire, and it grew without end."""
    store = TrajectoryStore(max_sessions=10, ttl_s=60.0, max_branches=3)
    sampled = Sampled([3], [-0.1], [0], "stop", {"role": "assistant", "content": "x"})
    for i in range(10):
        store.record("u1", [], None, Turn([1, 100 + i], [sampled]), new_branch=f"history edited {i}")
    session = store.get("u1")
    assert session is not None and [b.why for b in session.branches] == [f"history edited {i}" for i in (7, 8, 9)]
    assert session.last_turn is not None and session.last_turn.prompt_ids == [1, 109]
    assert store.evicted["branches"] == 7
    assert store.trajectory("u1")["num_turns"] == 3
    assert store.trajectory("u1")["num_requests"] == 10  # what the caller sent, dropped branches too


def test_a_long_session_holds_its_tokens_once_not_once_per_turn():
    """Each turn used to hold its whole prompt: 400 turns adding 10 tokens each took 6.9 MB for a
    4,400-token trajectory (0.5 MB now, its turns' replies and messages included), growing with
    the square of the turns. Now each turn holds its new ids, and the trajectory is still every
    token in place."""
    import tracemalloc

    store = TrajectoryStore(max_sessions=10, ttl_s=60.0)
    prompt = list(range(1000, 1010))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        base = None
        for turn_no in range(400):
            reply = [turn_no % 50] * 1
            sampled = Sampled(reply, [-0.5], [turn_no], "stop", {"role": "assistant", "content": str(turn_no)})
            reused = len(prompt) - 9 if base is not None else 0
            turn = Turn(list(prompt), [sampled], reused=reused)
            store.record("long", [], None, turn, new_branch=None if base is not None else "first turn", base=base)
            base = turn
            prompt = prompt + reply + list(range(2000 + turn_no, 2009 + turn_no))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_500_000, f"{held:,} bytes held for a 4,400-token session"
    view = store.trajectory("long")["branches"][-1]
    assert len(view["turns"]) == 400
    assert view["token_ids"] == prompt[:-9]  # the last turn's prompt and its reply
    assert sum(view["mask"]) == 400 and view["weight_versions"][-1] == 399
    last = store.get("long").last_turn  # type: ignore[union-attr]
    assert last is not None and last.prompt_ids == prompt[:-10]


async def test_two_turns_extending_one_turn_at_once_fork_a_branch_each_consistent():
    """Two requests of one session both extend turn 1 and run at the same time: the one recorded
    second forks a branch at turn 1 (it was appended after the first, as if it had extended it,
    so its branch's ids and mask described neither request)."""
    async with stack() as s:
        client = s.client()
        first = [{"role": "user", "content": "hi"}]
        head = {"extra_headers": {"x-session-id": "race"}}
        r1 = await client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, **head)
        after = [*first, reply_dict(r1.choices[0].message)]
        await asyncio.gather(
            client.chat.completions.create(model=MODEL, messages=[*after, {"role": "user", "content": "A"}], **head),
            client.chat.completions.create(model=MODEL, messages=[*after, {"role": "user", "content": "B b"}], **head),
        )
        record = await s.trajectory("race")
        assert [len(b["turns"]) for b in record["branches"]] == [2, 2]
        assert record["num_requests"] == 3  # the fork copied turn 0 into its branch: 4 turns, 3 requests
        assert record["branches"][1]["why"].startswith("concurrent turn: forked after turn 0")
        calls = {(tuple(p), tuple(o)) for p, o, _ in s.engine_calls}
        for branch in record["branches"]:  # every turn: the prompt and reply the engine saw, in place
            ids, mask = branch["token_ids"], branch["mask"]
            for turn in branch["turns"]:
                start, end = turn["prompt_tokens"], turn["prompt_tokens"] + turn["response_tokens"]
                assert (tuple(ids[:start]), tuple(ids[start:end])) in calls
                assert mask[start:end] == [1] * (end - start)


async def test_a_turn_that_ends_after_its_session_was_deleted_does_not_bring_it_back():
    store = TrajectoryStore(max_sessions=10, ttl_s=60.0)
    sampled = Sampled([3], [-0.1], [0], "stop", {"role": "assistant", "content": "x"})
    store.record("s", [], None, Turn([1, 2], [sampled]), new_branch=None)
    base = store.get("s").last_turn  # type: ignore[union-attr]
    assert store.end("s")
    late = Turn([1, 2, 3, 4], [sampled], reused=3)
    assert not store.record("s", [], None, late, new_branch=None, base=base)
    assert store.get("s") is None and store.late_turns == 1
    with pytest.raises(Exception, match="ended"):
        store.trajectory("s")
    assert store.record("s", [], None, Turn([1], [sampled]), new_branch=None)  # a new first turn: a new session


async def test_a_turn_that_ends_after_its_session_was_deleted_stays_out_of_a_new_session_under_its_id():
    """The old session's turn 2 is in flight when the session is deleted and a new one starts
    under the same id: turn 2 used to land in the new session as a branch of its own ("the turn
    it extended is no longer recorded"), the last branch, the one a trainer reads."""
    async with stack() as s:
        head = {"extra_headers": {"x-session-id": "again"}}
        client = s.client()
        first = [{"role": "user", "content": "hi"}]
        r1 = await client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, **head)
        held, release = asyncio.Event(), asyncio.Event()
        generate = s.replica.generate_with_load

        async def hold_the_next(request_id: str, prompt_ids: list[int], params: Any = None, **kw: Any) -> Any:
            if not held.is_set():
                held.set()
                await release.wait()
            return await generate(request_id, prompt_ids, params, **kw)

        s.replica.generate_with_load = hold_the_next
        old = [*first, reply_dict(r1.choices[0].message), {"role": "user", "content": "more"}]
        turn2 = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=old, max_tokens=8, **head))
        await held.wait()
        assert (await s.http.delete("/v1/sessions/again", headers=s.key("again"))).status_code == 200
        fresh = [{"role": "user", "content": "a new conversation"}]
        await client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=8, **head)
        release.set()
        await turn2  # answered: the caller gets its reply; only the record leaves it out
        record = await s.trajectory("again")
        assert [b["why"] for b in record["branches"]] == ["first turn"] and record["num_turns"] == 1
        assert s.gateway.trajectories.late_turns == 1


async def test_a_turn_served_without_logprobs_records_none_and_the_http_agent_passes_none_on():
    """The fleet may answer without logprobs (an attempt whose engine gave none: the client then
    reports none for the whole output). The trajectory recorded 0.0 for each sampled token, a
    probability of 1 that a trainer would use in its importance ratios."""
    from rollfleet.agent_loop.http_agent import HttpAgentLoop

    async with stack() as s:
        generate = s.gateway.service.client.generate

        async def without_logprobs(*args: Any, **kwargs: Any) -> Any:
            out = await generate(*args, **kwargs)
            return out.model_copy(update={"log_probs": None})

        s.gateway.service.client.generate = without_logprobs
        reply = await s.client("s1").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert reply.choices[0].message.content is not None
        branch = (await s.trajectory("s1"))["branches"][0]
        sampled = [lp for lp, m in zip(branch["logprobs"], branch["mask"]) if m]
        assert sampled and all(lp is None for lp in sampled)
        assert all(lp == 0.0 for lp, m in zip(branch["logprobs"], branch["mask"]) if not m)
        loop = HttpAgentLoop.__new__(HttpAgentLoop)
        loop.prompt_length, loop.response_length = 256, 64
        assert loop._output(s.gateway.trajectories.trajectory("s1")).response_logprobs is None


async def test_a_session_id_with_a_slash_can_be_read_rewarded_and_ended():
    """OpenAI's ``user`` is free text (``team/alice``): the turn was served and recorded, but the
    session routes matched no id with a slash (404 no route), so its trajectory could not be read
    and its record stayed until evicted."""
    async with stack() as s:
        sid = "team/alice"
        client = s.client()
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, user=sid
        )
        base = s.client(sid.replace("/", "%2F"))  # the session's base URL
        await base.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=4)
        got = await s.http.get("/v1/sessions/team%2Falice/trajectory", headers=s.key(sid))
        assert got.status_code == 200, got.text
        assert got.json()["session_id"] == sid and got.json()["num_requests"] == 2
        reward = await s.http.post("/v1/sessions/team%2Falice/reward", json={"reward": 1.0}, headers=s.key(sid))
        assert reward.status_code == 200
        ended = await s.http.delete("/v1/sessions/team%2Falice", headers=s.key(sid))
        assert ended.status_code == 200 and ended.json()["trajectory_freed"] is True
