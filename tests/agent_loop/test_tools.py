"""Tools: schemas from signatures, FunctionTool, and one turn's calls (errors, timeouts, truncation)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal, Optional

import pytest

from rollfleet.agent_loop.tools import (
    TRUNCATION_MARK,
    BaseTool,
    FunctionTool,
    ToolResult,
    ToolSession,
    function_schema,
    load_tools,
    truncate,
)
from rollfleet.config import MultiTurnConfig
from rollfleet.tool_parser import FunctionCall

pytestmark = pytest.mark.unit


def weather(city: str, unit: Literal["c", "f"] = "c", days: Optional[int] = None, tags: list[str] = ()) -> dict:
    """Get the weather forecast.

    More prose that is not part of the description.

    Args:
        city: The city name.
        unit: Temperature unit,
            Celsius or Fahrenheit.
    """
    return {"city": city, "unit": unit}


async def add(a: int, b: float) -> float:
    return a + b


def test_schema_from_signature():
    fn = function_schema(weather)["function"]
    assert fn["name"] == "weather"
    assert fn["description"] == "Get the weather forecast."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "The city name."}
    assert props["unit"] == {
        "enum": ["c", "f"],
        "type": "string",
        "default": "c",
        "description": "Temperature unit, Celsius or Fahrenheit.",
    }
    assert props["days"] == {"type": "integer", "default": None}
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert fn["parameters"]["required"] == ["city"]


async def test_function_tool_sync_async_and_bad_arguments():
    sync_tool, async_tool = FunctionTool(weather), FunctionTool(add)
    assert await sync_tool.execute("i", {"city": "Oslo"}) == '{"city": "Oslo", "unit": "c"}'
    assert await async_tool.execute("i", {"a": 1, "b": 2.5}) == "3.5"
    with pytest.raises(TypeError):
        await async_tool.execute("i", {"a": 1})


class CountingTool(BaseTool):
    """Records create/release; returns a reward."""

    def __init__(self):
        super().__init__({"type": "function", "function": {"name": "count", "parameters": {}}})
        self.created, self.released = [], []
        self.running = self.peak = 0

    async def create(self, instance_id, **kwargs):
        await asyncio.sleep(0.01)
        self.created.append((instance_id, kwargs))
        return instance_id

    async def execute(self, instance_id, parameters):
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.05)
        self.running -= 1
        return f"n={parameters['n']}", 0.5, {"ok": 1}

    async def release(self, instance_id):
        self.released.append(instance_id)


def boom() -> str:
    raise ValueError("bad day")


def sleepy() -> str:
    time.sleep(1.0)
    return "late"


def chatty() -> str:
    return "x" * 50 + "MIDDLE" + "y" * 50


async def test_session_runs_calls_concurrently_bounded_in_order_and_survives_failures():
    counting = CountingTool()
    tools = load_tools([counting, boom, sleepy, chatty])
    cfg = MultiTurnConfig(max_parallel_calls=2, tool_timeout_s=0.3, max_tool_response_length=20)
    session = ToolSession(tools, cfg, "traj", {"count": {"create_kwargs": {"seed": 7}}})
    calls = [FunctionCall("count", {"n": i}, id=f"call_{i}") for i in range(4)]
    calls += [
        FunctionCall("boom", {}, id="b"),
        FunctionCall("sleepy", {}, id="s"),
        FunctionCall("nope", {}, id="u"),
        FunctionCall("", id="e", error="tool call is not valid JSON"),
        FunctionCall("chatty", {}, id="c"),
        FunctionCall("count", {"nn": 1}, id="k"),
    ]
    start = time.perf_counter()
    outcomes = await session.run(calls)
    assert time.perf_counter() - start < 1.0  # the sleepy tool's timeout did not hold the turn up
    assert [o.call.id for o in outcomes] == [c.id for c in calls]
    assert [o.text for o in outcomes[:4]] == ["n=0", "n=1", "n=2", "n=3"]
    assert outcomes[0].reward == 0.5 and outcomes[0].metrics == {"ok": 1}
    assert counting.peak <= 2
    assert counting.created == [("traj:count", {"seed": 7})]  # one instance per trajectory and tool
    errors = {o.call.id: o.error for o in outcomes}
    assert errors == {
        "call_0": None,
        "call_1": None,
        "call_2": None,
        "call_3": None,
        "b": "exception",
        "s": "timeout",
        "u": "unknown_tool",
        "e": "bad_call",
        "c": None,
        "k": "exception",
    }
    assert "bad day" in outcomes[4].text and "timed out" in outcomes[5].text
    assert outcomes[8].text == "x" * 10 + TRUNCATION_MARK + "y" * 10
    assert outcomes[4].message() == {"role": "tool", "content": outcomes[4].text, "tool_call_id": "b", "name": "boom"}
    await session.release_all()
    assert counting.released == ["traj:count"]


class HangingRelease(CountingTool):
    """A sandbox whose teardown lost its network: release never returns."""

    def __init__(self, name: str):
        super().__init__()
        self.tool_schema = {"type": "function", "function": {"name": name, "parameters": {}}}

    async def release(self, instance_id):
        self.released.append(instance_id)
        await asyncio.Event().wait()


async def test_a_release_that_hangs_is_given_up_on_at_the_tool_timeout_and_the_others_go_on():
    """Releases had no timeout and ran one after another: one hung the trajectory forever."""
    hanging, hanging_too = HangingRelease("sandbox"), HangingRelease("shell")
    tools = load_tools([hanging, hanging_too])
    session = ToolSession(tools, MultiTurnConfig(tool_timeout_s=0.2), "traj", {})
    await session.run([FunctionCall("sandbox", {"n": 1}, id="a"), FunctionCall("shell", {"n": 2}, id="b")])
    await asyncio.wait_for(session.release_all(), 5)  # each given up on at its timeout
    assert hanging.released == ["traj:sandbox"] and hanging_too.released == ["traj:shell"]


def test_truncate_sides():
    text = "abcdefghij"
    assert truncate(text, 20) == text
    assert truncate(text, 4, "left") == "abcd" + TRUNCATION_MARK
    assert truncate(text, 4, "right") == TRUNCATION_MARK + "ghij"
    assert truncate(text, 4, "middle") == "ab" + TRUNCATION_MARK + "ij"
    with pytest.raises(ValueError):
        truncate(text, 4, "up")


def test_load_tools_from_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - function: rollfleet.reward.rules.exact_match\n    name: judge\n")
    tools = load_tools(tool_config_path=str(path))
    assert list(tools) == ["judge"]
    assert tools["judge"].tool_schema["function"]["parameters"]["required"] == ["solution_str", "ground_truth"]
    with pytest.raises(ValueError, match="two tools"):
        load_tools([weather, weather])
    # a function entry's schema is the tool's (it was dropped: published under the function's name)
    path.write_text(
        "tools:\n  - function: rollfleet.reward.rules.exact_match\n    tool_schema:\n      type: function\n"
        "      function: {name: judge_it, description: Judge., parameters: {type: object, properties: {}}}\n"
    )
    assert list(load_tools(tool_config_path=str(path))) == ["judge_it"]
    path.write_text("tools:\n  - function: rollfleet.reward.rules.exact_match\n    config: {x: 1}\n")
    with pytest.raises(ValueError, match=r"not \['config'\]"):
        load_tools(tool_config_path=str(path))
    path.write_text(  # a name beside a schema that names the tool: one of them would be dropped
        "tools:\n  - function: rollfleet.reward.rules.exact_match\n    name: other\n    tool_schema:\n"
        "      type: function\n      function: {name: judge_it, parameters: {type: object}}\n"
    )
    with pytest.raises(ValueError, match=r"remove \['name'\]"):
        load_tools(tool_config_path=str(path))


async def test_an_async_callable_object_and_a_positional_only_function_run_as_tools():
    """An object whose __call__ is async ran on a thread: the model was told the coroutine's repr,
    as a success. math.sqrt's x is positional-only: binding it by name failed every call."""
    import math

    class Search:
        async def __call__(self, query: str) -> str:
            return "found " + query

    assert await FunctionTool(Search(), name="search").execute("i", {"query": "x"}) == "found x"
    assert await FunctionTool(math.sqrt).execute("i", {"x": 4}) == "2.0"

    def power(base=2, exp=3, /):
        return base**exp

    assert await FunctionTool(power).execute("i", {"exp": 5}) == "32"  # a gap takes its default, not the next value
    with pytest.raises(TypeError):
        await FunctionTool(math.sqrt).execute("i", {})
    with pytest.raises(TypeError):
        await FunctionTool(math.sqrt).execute("i", {"x": 4, "y": 1})
    # a builtin without a signature (no keywords either) runs with the schema its YAML gives
    params = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}
    schema = {"type": "function", "function": {"name": "hypot", "description": "h", "parameters": params}}
    hypot = FunctionTool(math.hypot, tool_schema=schema)
    assert await hypot.execute("i", {"y": 4, "x": 3}) == "5.0"
    with pytest.raises(TypeError, match="unexpected"):
        await hypot.execute("i", {"z": 1})


async def test_tool_result_passthrough():
    def scored(x: int) -> ToolResult:
        return ToolResult(str(x * 2), reward=1.0)

    result = await FunctionTool(scored).execute("i", {"x": 2})
    assert result == ToolResult("4", reward=1.0)
