"""Running one turn's tool calls: per-trajectory instances, concurrency, timeouts, truncation.

Everything that can go wrong in a tool becomes text for the model (unknown tool, bad arguments,
an exception, a timeout, a malformed call) and the trajectory goes on; only cancellation of the
trajectory itself propagates. Calls of one turn run concurrently, at most ``max_parallel_calls``
at a time (verl runs only the first ``max_parallel_calls`` calls and silently drops the rest), and
their results come back in call order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from rollfleet.agent_loop.tools.base import BaseTool, ToolResult, to_tool_result
from rollfleet.config import MultiTurnConfig
from rollfleet.tool_parser import FunctionCall

logger = logging.getLogger(__name__)

TRUNCATION_MARK = "...(truncated)..."
#: Characters kept of an error message (unknown tool, exception, timeout) whatever the output limit.
ERROR_TEXT_LIMIT = 256


def truncate(text: str, max_length: int, side: str = "middle") -> str:
    """Cut ``text`` to about ``max_length`` characters (plus a marker), keeping (verl's meaning):
    ``left`` the beginning, ``right`` the end, ``middle`` both ends."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + TRUNCATION_MARK
    if side == "right":
        return TRUNCATION_MARK + text[-max_length:]
    if side == "middle":
        head = max_length // 2
        return text[:head] + TRUNCATION_MARK + text[len(text) - (max_length - head) :]
    raise ValueError(f"truncate side must be left, right or middle, got {side!r}")


@dataclass
class ToolOutcome:
    """What one call produced, in the form the loop feeds back and records."""

    call: FunctionCall
    text: str
    reward: Optional[float] = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None  #: ``unknown_tool`` | ``bad_call`` | ``exception`` | ``timeout``
    seconds: float = 0.0

    def message(self) -> dict[str, Any]:
        return {"role": "tool", "content": self.text, "tool_call_id": self.call.id, "name": self.call.name}


class ToolSession:
    """One trajectory's view of the tools: creates instances on first use, releases them all."""

    def __init__(
        self,
        tools: Mapping[str, BaseTool],
        config: MultiTurnConfig,
        trajectory_id: str,
        tools_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.tools = tools
        self.config = config
        self.trajectory_id = trajectory_id
        self.tools_kwargs = dict(tools_kwargs or {})
        self._instances: dict[str, asyncio.Task[str]] = {}

    async def run(self, calls: list[FunctionCall]) -> list[ToolOutcome]:
        """Run one turn's calls; results in call order."""
        sem = asyncio.Semaphore(self.config.max_parallel_calls)

        async def bounded(call: FunctionCall) -> ToolOutcome:
            async with sem:
                return await self._run_one(call)

        return list(await asyncio.gather(*(bounded(c) for c in calls)))

    async def _run_one(self, call: FunctionCall) -> ToolOutcome:
        cfg = self.config
        start = time.perf_counter()
        if call.error is not None:
            return self._fail(call, "bad_call", f"Error: invalid tool call: {call.error}", start)
        tool = self.tools.get(call.name)
        if tool is None:
            return self._fail(
                call, "unknown_tool", f"Error: unknown tool '{call.name}'; available tools: {sorted(self.tools)}", start
            )
        try:
            result = await asyncio.wait_for(self._execute(tool, call), cfg.tool_timeout_s)
        except asyncio.TimeoutError:
            return self._fail(
                call, "timeout", f"Error: tool '{call.name}' timed out after {cfg.tool_timeout_s:g} s", start
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the model should read what went wrong; the trajectory goes on
            logger.debug("tool %s failed: %r", call.name, exc)
            return self._fail(
                call, "exception", f"Error: tool '{call.name}' failed: {type(exc).__name__}: {exc}", start
            )
        text = truncate(result.text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)
        return ToolOutcome(call, text, result.reward, result.metrics, None, time.perf_counter() - start)

    async def _execute(self, tool: BaseTool, call: FunctionCall) -> ToolResult:
        instance_id = await self._instance(tool)
        return to_tool_result(await tool.execute(instance_id, dict(call.arguments)))

    async def _instance(self, tool: BaseTool) -> str:
        task = self._instances.get(tool.name)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            kwargs = dict((self.tools_kwargs.get(tool.name) or {}).get("create_kwargs", {}))
            # A task, not a coroutine, so parallel calls of one tool share a single create().
            task = asyncio.ensure_future(tool.create(f"{self.trajectory_id}:{tool.name}", **kwargs))
            self._instances[tool.name] = task
        return await asyncio.shield(task)

    def _fail(self, call: FunctionCall, kind: str, text: str, start: float) -> ToolOutcome:
        # Our own error text is kept readable even under a tiny output limit (an exception's
        # message can still be long, hence a cap).
        text = truncate(text, max(self.config.max_tool_response_length, ERROR_TEXT_LIMIT), "left")
        return ToolOutcome(call, text, None, {}, kind, time.perf_counter() - start)

    async def release_all(self) -> None:
        """Release every created instance, at once and each within ``tool_timeout_s`` (errors
        logged, never raised: the trajectory is done). A release that hangs (a sandbox whose
        teardown lost its network) held the trajectory, and a batch cancelled around it, forever."""
        releases = []
        for name, task in list(self._instances.items()):
            if not task.done():  # a create() that outlived its call's timeout: released once it is done
                releases.append(self._release_once_created(name, task))
                continue
            if task.cancelled() or task.exception() is not None:
                continue  # nothing was created
            releases.append(self._release(name, task.result()))
        self._instances.clear()
        await asyncio.gather(*releases)

    async def _release_once_created(self, name: str, task: "asyncio.Future[str]") -> None:
        """A create() still running: waited for (within ``tool_timeout_s``) and its instance
        released. Cancelled, it was never released: a sandbox it had started allocating leaked.
        Past the wait it is cancelled and its instance id (known ahead) released all the same."""
        timeout = self.config.tool_timeout_s
        try:
            instance_id = await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            task.cancel()
            instance_id = f"{self.trajectory_id}:{name}"
            logger.warning("creating tool %s instance %s took over tool_timeout_s=%ss", name, instance_id, timeout)
        except Exception:
            return  # the create failed: nothing was created
        await self._release(name, instance_id)

    async def _release(self, name: str, instance_id: str) -> None:
        timeout = self.config.tool_timeout_s
        try:
            await asyncio.wait_for(self.tools[name].release(instance_id), timeout)
        except asyncio.TimeoutError:
            logger.warning("releasing tool %s instance %s took over tool_timeout_s=%ss", name, instance_id, timeout)
        except Exception:
            logger.exception("releasing tool %s instance %s failed", name, instance_id)


__all__ = ["ToolSession", "ToolOutcome", "truncate", "TRUNCATION_MARK"]
