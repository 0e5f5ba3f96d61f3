"""``http_agent``: train an agent that only speaks the OpenAI HTTP API, unchanged.

Agent frameworks (an OpenAI-SDK agent, LangGraph, a coding agent in a sandbox) own their loop:
they send chat requests and run tools themselves, and never hand over token ids. This loop gives
each sample's run its own session of a gateway that this worker serves on loopback, over the
worker's own fleet client (so weight updates mid-run are resumed inside, as for every loop):

1. the agent is started with ``base_url = <gateway>/sessions/<id>/v1`` and the sample
   (``agent.http_agent.agent``: a callable, called with an :class:`AgentRun`; or
   ``agent.http_agent.command``: a program, given the same in ``OPENAI_BASE_URL``,
   ``OPENAI_API_KEY`` and ``ROLLFLEET_*`` environment variables);
2. the gateway records every turn token for token (:mod:`rollfleet.gateway.trajectories`): the
   exact prompt ids, sampled ids, logprobs and weight versions, with no retokenisation drift;
3. when the agent is done, its last branch becomes the :class:`AgentLoopOutput` every trainer
   mode consumes; the reward is what the agent returned (or posted to the session, or printed as
   ``{"reward": x}``), else the sample's verifiable reward scores the model's text as usual.

A run that fails or outlives ``agent.http_agent.timeout_s`` keeps what it recorded, with reward 0
and the error in ``extra_fields["agent_error"]``; a run that recorded nothing raises. When a run
ends, however it ends, its session is closed: a request the agent still sends is refused (409
``session_ended``) before it generates. A command's whole process group is killed then; a
synchronous callable cannot be stopped (it runs on a thread), so it should honour a deadline
of its own.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib.util
import inspect
import json
import math
import os
import re
import signal
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rollfleet.agent_loop.base import AgentLoopBase, AgentLoopContext, AgentLoopOutput
from rollfleet.agent_loop.registry import register
from rollfleet.registry import resolve
from rollfleet.types import SamplingParams

#: Sample keys that are the trainer's bookkeeping, not the agent's input.
_PRIVATE_KEYS = ("request_id", "sampling_params", "agent_name")


@dataclass
class AgentRun:
    """What an agent gets: where to send its OpenAI requests, and its sample."""

    base_url: str  #: ``http://127.0.0.1:<port>/sessions/<id>/v1``: the OpenAI client's base URL
    api_key: str  #: any string works; this is the session's key (what reading or scoring it takes)
    session_id: str
    model: str
    sample: dict[str, Any]  #: the dataset row (``raw_prompt`` messages, ground truth...)
    #: The trainer's sampling settings, as hints (``max_tokens``: the whole trajectory's budget).
    sampling: dict[str, Any] = field(default_factory=dict)
    reward_url: str = ""  #: POST ``{"reward": x}`` here with header ``X-Rollfleet-Session-Key: api_key``


class _WorkerGateway:
    """One gateway per worker process, started on first use, on loopback and a free port."""

    def __init__(self, context: AgentLoopContext) -> None:
        self.context = context
        self.gateway: Any = None
        self.server: Any = None
        self._lock = asyncio.Lock()

    async def url(self) -> str:
        async with self._lock:
            if self.server is None:
                from rollfleet.gateway import Gateway, GatewayServer, TextCodec

                # the config's gateway section (tool-call parser, model name, session bounds), served
                # on loopback, on a free port, recording every turn
                config = self.context.gateway.model_copy(
                    update={"host": "127.0.0.1", "port": 0, "capture_trajectories": True}
                )
                gateway = Gateway(self.context.client, TextCodec(self.context.tokenizer), config=config,
                                  rollout=self.context.rollout)  # fmt: skip
                self.server = await GatewayServer(gateway.app, header_timeout_s=config.header_timeout_s).start()
                self.gateway = gateway
        return str(self.server.url)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None


@register("http_agent")
class HttpAgentLoop(AgentLoopBase):
    def __init__(
        self,
        context: AgentLoopContext,
        *,
        agent: Optional[str] = None,
        command: Optional[list[str]] = None,
        timeout_s: Optional[float] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(context, **kwargs)
        settings = context.agent.http_agent
        self.agent_path = agent or settings.agent
        self.command = command or settings.command
        self.timeout_s = timeout_s or settings.timeout_s
        if (self.agent_path is None) == (self.command is None):
            raise ValueError("http_agent needs exactly one of agent.http_agent.agent (a callable) or .command")
        self._agent_fn: Optional[Callable[..., Any]] = load_agent(self.agent_path) if self.agent_path else None
        self._gateway = _WorkerGateway(context)
        self._max_threads = context.agent.max_concurrent_trajectories
        self._threads: Optional[ThreadPoolExecutor] = None  # the synchronous agents' own (made on first use)

    async def run(self, sampling_params: SamplingParams, **sample: Any) -> AgentLoopOutput:
        url = await self._gateway.url()
        gateway = self._gateway.gateway
        session = session_id_for(self.request_id_for(sample))
        key = gateway.session_keys.key(session)
        run = AgentRun(
            base_url=f"{url}/sessions/{session}/v1",
            api_key=key,
            session_id=session,
            model=gateway.model_names[0],
            sample={k: v for k, v in sample.items() if k not in _PRIVATE_KEYS},
            sampling={"max_tokens": self.response_length, **sampling_params},  # the trajectory's budget
            reward_url=f"{url}/v1/sessions/{session}/reward",
        )
        store = gateway.trajectories
        error: Optional[str] = None
        reward: Optional[float] = None
        try:
            try:
                reward = await asyncio.wait_for(self._start(run), self.timeout_s)
            except asyncio.TimeoutError:
                error = f"the agent ran over agent.http_agent.timeout_s={self.timeout_s:g}s"
            except Exception as exc:  # the agent's own failure: keep what it recorded, score it 0
                error = f"{type(exc).__name__}: {exc}"
            recorded = store.get(session)
            if recorded is None or recorded.last_turn is None:
                raise RuntimeError(
                    f"http_agent: the agent made no chat request in its session{f' ({error})' * bool(error)}"
                )
            record = store.trajectory(session)
        finally:  # cancelled too: closed, so an agent still running (on a thread) generates no more
            store.close(session, "its http_agent run ended")
            self.client.finish_session(session)
            gateway.session_keys.forget(session)
        if reward is None and record["reward"] is not None:
            reward = float(record["reward"])
        output = self._output(record)
        if error is not None:
            output.reward_score, output.extra_fields["agent_error"] = 0.0, error
        elif reward is not None:
            output.reward_score = float(reward)
        return output

    async def close(self) -> None:
        await self._gateway.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    async def _start(self, run: AgentRun) -> Optional[float]:
        fn = self._agent_fn
        if fn is not None:
            # A synchronous agent runs on a thread: on this loop it would block the very gateway
            # its requests go to. A pool of its own, one thread per trajectory the worker runs at
            # once: on the loop's shared default one (6 threads on 2 cores) agents waited for a
            # thread while their timeout ran, and were cut off, or never started, for it.
            if inspect.iscoroutinefunction(fn):
                result = await fn(run)
            else:
                if self._threads is None:
                    self._threads = ThreadPoolExecutor(self._max_threads, thread_name_prefix="rollfleet-http-agent")
                call = functools.partial(contextvars.copy_context().run, fn, run)
                result = await asyncio.get_running_loop().run_in_executor(self._threads, call)
            if inspect.isawaitable(result):
                result = await result
            return None if result is None else finite_reward(result)
        return await run_command(list(self.command or []), run)

    def _output(self, record: dict[str, Any]) -> AgentLoopOutput:
        """The last branch (the conversation the agent ended with) as a trajectory: the first
        turn's prompt, then everything after it, within ``prompt_length`` / ``response_length``."""
        branch = record["branches"][-1]
        start = branch["turns"][0]["prompt_tokens"]
        ids, mask = branch["token_ids"], branch["mask"]
        end = start + self.response_length
        versions = [-1 if v is None else int(v) for v in branch["weight_versions"][start:end]]
        logprobs = branch["logprobs"][start:end]  # None where the engine gave none: then none at all
        sampled = [v for v, m in zip(versions, mask[start:end]) if m and v >= 0]
        output = AgentLoopOutput(
            prompt_ids=ids[:start][-self.prompt_length :],
            response_ids=ids[start:end],
            response_mask=mask[start:end],
            response_logprobs=None if None in logprobs else logprobs,
            # verl's count, as tool_agent's: the model's turns, the user / tool turns between them, + 1
            num_turns=2 * len(branch["turns"]),
            response_versions=versions,
        )
        output.metrics.num_generate_calls = record["num_requests"]  # every chat request it answered
        output.extra_fields.update(
            min_global_steps=min(sampled, default=None),
            max_global_steps=max(sampled, default=None),
            branches=len(record["branches"]),
            truncated=len(ids) > end or start > self.prompt_length,
            # the gateway resumes aborted turns itself: one it answered "abort" gave up resuming
            resume_exhausted=any(turn["finish_reason"] == "abort" for turn in branch["turns"]),
        )
        return output


def load_agent(path: str) -> Callable[..., Any]:
    """``'pkg.module:fn'`` or ``'path/to/file.py:fn'`` -> the callable."""
    file, sep, name = path.rpartition(":")
    if sep and file.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"rollfleet_http_agent_{abs(hash(file))}", file)
        if spec is None or spec.loader is None:
            raise ImportError(f"agent.http_agent.agent: cannot load {file}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, name, None)
    else:
        fn = resolve(path)
    if not callable(fn):
        raise TypeError(f"agent.http_agent.agent: {path!r} is not a callable")
    return fn


async def run_command(argv: list[str], run: AgentRun) -> Optional[float]:
    """Run the agent program for one sample; its last stdout line may be ``{"reward": x}``."""
    env = {
        **os.environ,
        "OPENAI_BASE_URL": run.base_url,
        "OPENAI_API_KEY": run.api_key,
        "ROLLFLEET_SESSION_ID": run.session_id,
        "ROLLFLEET_MODEL": run.model,
        "ROLLFLEET_SAMPLE": json.dumps(run.sample, default=str),
        "ROLLFLEET_SAMPLING": json.dumps(run.sampling, default=str),
        "ROLLFLEET_REWARD_URL": run.reward_url,
    }
    argv = [sys.executable if a == "{python}" else a for a in argv]
    # Its own process group: the program and whatever it started (a shell, workers) are stopped
    # together when the run ends; killing the program alone left its children sending requests.
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = await proc.communicate()
    finally:  # timed out (cancelled), or done: nothing it started outlives the run
        _kill_group(proc.pid)
        await proc.wait()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"agent command exited {proc.returncode}: {' | '.join(tail)}")
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    value = last.get("reward") if isinstance(last, dict) else None
    return finite_reward(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # every process of it has exited already
        pass


def finite_reward(value: Any) -> float:
    """The reward an agent returned, as a float; NaN or an infinity is the agent's error (scored 0
    with it), never a score: one would make its group's advantages and the step's loss NaN."""
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the agent's reward is {reward}: a reward must be a finite number")
    return reward


def session_id_for(request_id: str) -> str:
    """A gateway session id for a sample: its ``request_id`` with every character a URL path
    would read otherwise (``/``, ``?``, ``#``, spaces...) made ``_`` (routes match the decoded
    path, so escaping does not do), cut to 128 characters, plus a random suffix (siblings and
    ids made equal by the cleaning stay apart)."""
    return f"{_UNSAFE_IN_PATH.sub('_', request_id)[:128]}-{uuid.uuid4().hex[:8]}"


_UNSAFE_IN_PATH = re.compile(r"[^A-Za-z0-9._~-]")


__all__ = ["HttpAgentLoop", "AgentRun", "finite_reward", "load_agent", "run_command", "session_id_for"]
