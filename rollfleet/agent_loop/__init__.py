"""The agent-loop layer: any agent runs on the fleet through the client, nothing else.

* :class:`AgentLoopBase` / :func:`register` — write a loop, give it a name;
* ``single_turn_agent`` and ``tool_agent`` — the built-in loops;
* :class:`AgentLoopWorker` — runs loops for samples over one client (a Ray actor, or in-process);
* :class:`AgentLoopManager` / :class:`FullyAsyncAgentLoopManager` — batches (or streams) of
  prompts in, :class:`RolloutBatch` out;
* :mod:`~rollfleet.agent_loop.tools`, :mod:`~rollfleet.tool_parser` — tools and the
  tool-call formats.

To add a loop::

    from rollfleet.agent_loop import AgentLoopBase, AgentLoopOutput, register

    @register("my_agent")
    class MyAgentLoop(AgentLoopBase):
        async def run(self, sampling_params, **sample) -> AgentLoopOutput:
            prompt_ids, _ = self.prompt_ids_of(sample)
            out = await self.client.generate(self.request_id_for(sample), prompt_ids=prompt_ids,
                                             sampling_params={**sampling_params, "max_tokens": 64})
            ...

and make sure the module is imported in the workers: name it in the YAML file
``agent.agent_loop_config_path`` (``- name: my_agent`` / ``_target_: my_pkg.MyAgentLoop``).
Keep per-trajectory state in ``run``'s locals: one loop instance serves all of a worker's
trajectories.
"""

from rollfleet.agent_loop.base import AgentLoopBase, AgentLoopContext, AgentLoopMetrics, AgentLoopOutput
from rollfleet.agent_loop.batch import RolloutBatch, collate, timing_metrics
from rollfleet.agent_loop.chat import ChatRenderer, ChatTemplateError
from rollfleet.agent_loop.fully_async import FullyAsyncAgentLoopManager
from rollfleet.agent_loop.manager import AgentLoopManager
from rollfleet.agent_loop.registry import get_agent_loop, list_agent_loops, load_agent_loop_config, register
from rollfleet.agent_loop.single_turn import SingleTurnAgentLoop
from rollfleet.agent_loop.tool_agent import ToolAgentLoop
from rollfleet.agent_loop.tools import BaseTool, FunctionTool, ToolResult
from rollfleet.agent_loop.worker import AgentLoopWorker, AgentLoopWorkerActor, load_tokenizer

__all__ = [
    "AgentLoopBase",
    "AgentLoopContext",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "register",
    "get_agent_loop",
    "list_agent_loops",
    "load_agent_loop_config",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "AgentLoopWorker",
    "AgentLoopWorkerActor",
    "AgentLoopManager",
    "FullyAsyncAgentLoopManager",
    "RolloutBatch",
    "collate",
    "timing_metrics",
    "ChatRenderer",
    "ChatTemplateError",
    "BaseTool",
    "FunctionTool",
    "ToolResult",
    "load_tokenizer",
]
