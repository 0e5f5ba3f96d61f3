"""The other top-level sections (``ray``, ``agent``, ``gateway``, ``trainer``) and the whole tree."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollfleet.config.base import _Section
from rollfleet.config.rollout import RolloutConfig


class RayConfig(_Section):
    """Where Ray runs. No address: an embedded local cluster is started."""

    address: Optional[str] = Field(
        None,
        description="An existing cluster ('auto', 'host:port' or 'ray://host:10001'); None starts an embedded "
        "one on loopback.",
    )
    num_cpus: Optional[int] = Field(None, ge=1, description="Logical CPUs of the embedded cluster.")
    num_gpus: Optional[int] = Field(None, ge=0, description="GPUs of the embedded cluster; None: what Ray detects.")
    ship_package: bool = Field(
        True,
        description="When joining a cluster, ship this rollfleet package to every node (runtime_env py_modules) "
        "so worker nodes need no install of their own.",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict, description="Extra Ray runtime_env for the job (env_vars, pip, working_dir, ...)."
    )
    namespace: str = "rollfleet"
    include_dashboard: bool = False


class MultiTurnConfig(_Section):
    """Multi-turn tool calling (verl's ``rollout.multi_turn``)."""

    max_assistant_turns: Optional[int] = Field(None, ge=1, description="None: bounded by the budget only.")
    max_user_turns: Optional[int] = Field(None, ge=1)
    max_parallel_calls: int = Field(4, ge=1, description="Tool calls run concurrently per turn.")
    max_tool_response_length: int = Field(256, ge=1, description="Characters kept of a tool's output.")
    tool_response_truncate_side: Literal["left", "right", "middle"] = "middle"
    tool_timeout_s: float = Field(30.0, gt=0)
    format: str = Field("hermes", description="Tool-call parser: see rollfleet.tool_parser.")
    tool_config_path: Optional[str] = Field(
        None,
        description="YAML listing tools by import path (a BaseTool subclass or a plain function); "
        "see rollfleet.agent_loop.tools.load_tools.",
    )


class HttpAgentConfig(_Section):
    """The ``http_agent`` loop: an agent that only speaks the OpenAI HTTP API, trained as it is."""

    agent: Optional[str] = Field(
        None,
        description="The agent as a callable: 'pkg.module:fn' or 'path/to/file.py:fn'; it is called with one "
        "run (base_url, api_key, session_id, model, sample, sampling) and may return the reward.",
    )
    command: Optional[list[str]] = Field(
        None,
        description="The agent as a program (argv), run once per sample with OPENAI_BASE_URL, OPENAI_API_KEY and "
        'ROLLFLEET_* in its environment; its last stdout line may be {"reward": x}.',
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="Most one agent run may take; then it is scored 0 with the error. An async agent or a command is "
        "stopped; a synchronous callable runs on a thread, which cannot be: what it sends after is not trained on.",
    )


class AgentConfig(_Section):
    """Agent-loop workers (verl's ``rollout.agent``)."""

    num_workers: int = Field(2, ge=1, description="AgentLoopWorker actors; each holds one client.")
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: Optional[str] = Field(None, description="YAML naming extra loops by import path.")
    max_concurrent_trajectories: int = Field(256, ge=1, description="Per worker.")
    default_reward: Optional[str] = Field(
        None,
        description="Reward function (rollfleet.reward registry) for samples whose reward spec names none; "
        "None: such samples get no score.",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    http_agent: HttpAgentConfig = Field(default_factory=HttpAgentConfig)


class GatewayConfig(_Section):
    """The OpenAI-compatible HTTP front door."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port.")
    served_model_name: Optional[str] = Field(None, description="Model name in /v1/models; defaults to rollout.model.")
    admin_token: Optional[str] = Field(None, description="Bearer token for /admin; admin routes are off without one.")
    session_secret: Optional[str] = Field(
        None,
        description="Key of the session keys a caller needs to end its session (DELETE /v1/sessions/{id}); set the same "
        "value on gateways behind one address. None: random per gateway process.",
    )
    request_timeout_s: float = Field(600.0, gt=0)
    prometheus_file: Optional[str] = Field(None, description="Write a Prometheus scrape config here at start-up.")
    tokenizer: Optional[str] = Field(
        None, description="Tokenizer folder (or built-in model name); defaults to rollout.model's folder."
    )
    prometheus_port: Optional[int] = Field(
        None, ge=1, le=65535, description="After writing prometheus_file, ask the Prometheus on this port to reload."
    )
    prometheus_scrape_interval: str = Field(
        "10s", description="scrape_interval of the jobs written to prometheus_file."
    )
    stream_chunk_tokens: int = Field(
        8,
        ge=1,
        description="Tokens per SSE chunk when a finished result is streamed whole (a batch of several prompts, "
        "echo, or a tool-call format without a call marker); one prompt streams as it is sampled.",
    )
    max_n: int = Field(16, ge=1, description="Largest 'n' (choices per prompt) one request may ask for.")
    status_poll_interval_s: float = Field(
        2.0, gt=0, description="How often fleet health, versions and replica stats are polled for /metrics."
    )
    access_log: bool = Field(False, description="uvicorn access log (one line per request: costs throughput).")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body; a larger one is answered 413 before it is read."
    )
    body_timeout_s: float = Field(30.0, gt=0, description="Time to receive a whole request body (slow senders: 408).")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a new connection has to send a complete request line and headers; then closed."
    )
    max_connections: int = Field(
        4096, ge=1, description="Connections plus requests in progress before new requests get 503 (uvicorn's cap)."
    )
    max_prompt_chars: int = Field(
        2_000_000, ge=1, description="Most characters of prompt text (all messages together) sent to the tokenizer."
    )
    max_generations: int = Field(
        64, ge=1, description="Most generations one request may start: prompts in the batch x n."
    )
    max_session_id_chars: int = Field(256, ge=1, description="Longest session id (header, session_id or user).")
    tokenizer_threads: int = Field(
        4,
        ge=1,
        description="Threads that tokenize and render chat templates, off the event loop (a long prompt must not "
        "stall other requests).",
    )
    allow_caller_chat_template: bool = Field(
        False,
        description="Let callers pass their own Jinja chat_template in chat_template_kwargs (caller-controlled code "
        "on the gateway: off unless every caller is trusted). Off: only the served model's template renders.",
    )
    no_server_wait_s: float = Field(
        10.0,
        ge=0,
        description="How long a request waits for a routable replica before the gateway answers 503 "
        "(an HTTP caller should hear back sooner than a trainer's rollout waits).",
    )
    capture_trajectories: bool = Field(
        True,
        description="Record each session's exact token ids, masks, logprobs and weight versions "
        "(GET /v1/sessions/{id}/trajectory); a turn that extends the last one reuses its ids.",
    )
    max_sessions: int = Field(
        10_000, ge=1, description="Most sessions whose trajectories are kept; the least recently used goes first."
    )
    session_ttl_s: float = Field(3600.0, gt=0, description="A session untouched this long is forgotten.")
    max_session_branches: int = Field(
        64,
        ge=1,
        description="Most branches one session's trajectory keeps (a caller that edits its history starts one); "
        "the oldest go first.",
    )
    tool_call_parser: str = Field(
        "hermes", description="How chat replies become tool_calls when a request passes tools (rollfleet.tool_parser)."
    )

    @model_validator(mode="after")
    def _secrets_as_compared(self) -> "GatewayConfig":
        """A token read from a file usually ends in a newline; the credential a caller sends is
        stripped, so such a token turned the admin routes on and let no request through."""
        token = self.admin_token  # (session_secret is a key, never compared: its bytes are as given)
        if token is not None and (not token.strip() or token != token.strip()):
            raise ValueError("gateway.admin_token must not be blank or begin or end with whitespace")
        return self

    @model_validator(mode="after")
    def _port_with_its_file(self) -> "GatewayConfig":
        """A reload port reloads what the file says: without a file nothing is written or reloaded
        (as ``rollout.prometheus`` refuses an ``enable`` without its ``file``)."""
        if self.prometheus_port is not None and not self.prometheus_file:
            raise ValueError("gateway.prometheus_port requires gateway.prometheus_file (the scrape config it reloads)")
        return self


class TrainerConfig(_Section):
    """Trainer selection (``trainer_mode``) and the knobs shared by all modes.

    An open section here: its keys are those of ``rollfleet.trainer.config.TrainConfig`` (the
    trainer layer), checked by :func:`load_config` through the ``trainer`` section validator, not
    at construction (see the module docstring for why).
    """

    trainer_mode: str = Field("sync", description="Registered trainer name: sync | colocate_async | separate_async.")
    model_config = ConfigDict(extra="allow", validate_assignment=True)


class RollfleetConfig(BaseModel):
    """The whole tree. Unknown top-level sections are kept (for tools built on top)."""

    model_config = ConfigDict(extra="allow")

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
