"""Per-engine sections: ``rollout.sim``, ``rollout.vllm``, ``rollout.sglang``."""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, field_validator, model_validator

from rollfleet.config.base import _Section


class SimEngineConfig(_Section):
    """Parameters of the simulated engine.

    Defaults resemble a 7B dense model (Qwen2.5-7B class, bf16) on one H100-80GB under vLLM:
    a decode step of ~7 ms plus ~0.06 ms per running sequence (so ~22 ms at 256 sequences, i.e.
    ~11k output tokens/s), prefill at ~25k tokens/s (0.04 ms per uncached prompt token),
    ~110k tokens of KV cache (0.5 MB per token in bf16 with GQA off, ~55 GB left after weights),
    16-token KV blocks and at most 256 running sequences.
    """

    vocab_size: int = Field(32000, ge=16, description="Token ids are drawn from [0, vocab_size).")
    eos_token_id: int = Field(2, ge=0, description="Token that ends a response with stop_reason 'stop'.")
    max_model_len: int = Field(
        32768,
        ge=2,
        description="Context length: prompt + response tokens. In a rollout it is rollout.max_model_len (given "
        "here alone, it sets that; both given, they must agree).",
    )
    step_base_ms: float = Field(7.0, ge=0, description="Fixed cost of one engine step (ms).")
    step_per_seq_ms: float = Field(0.06, ge=0, description="Decode cost per running sequence per step (ms).")
    prefill_per_token_ms: float = Field(0.04, ge=0, description="Cost per uncached prompt token (ms).")
    step_per_context_token_ms: float = Field(
        0.0,
        ge=0,
        description="Cost per token of context the running sequences hold, per step (ms): reading their KV "
        "cache. 0 keeps a step's cost independent of context length; ~0.00015 is a 7B model without GQA "
        "on an H100 (0.5 MB of KV per token read at ~3.3 TB/s).",
    )
    kv_capacity_tokens: int = Field(110_000, ge=16, description="KV-cache capacity in tokens.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block (unit of prefix caching).")
    prefix_cache_blocks: Optional[int] = Field(
        None,
        ge=0,
        description="Most cached blocks no running request holds (an LRU over token blocks). None: as many "
        "as the KV cache has free, as in vLLM, whose cached blocks are its free ones (a block is evicted "
        "when a new one is needed); a number bounds them further; 0 disables the prefix cache.",
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one running batch.")
    cache_on_prefill: bool = Field(
        False,
        description="Insert a request's prompt blocks into the prefix cache once it is prefilled, as vLLM "
        "does (requests that run at the same time then share a system or group prompt); false: only when "
        "it finishes.",
    )
    mean_response_tokens: float = Field(
        400.0, gt=0, description="Mean of the long-tailed (log-normal) natural response length."
    )
    response_sigma: float = Field(
        1.0, ge=0, description="Sigma of the log-normal response length; larger = longer tail."
    )
    response_lengths: Optional[list[Annotated[int, Field(ge=1)]]] = Field(
        None,
        min_length=1,
        description="Natural response lengths to draw from (e.g. those of a real run) instead of the log-normal "
        "above: each response takes one of them, chosen by its prompt and sample seed.",
    )
    time_scale: float = Field(
        1.0, gt=0, description="Simulated seconds per wall second (60 = a GPU minute in a second)."
    )
    seed: int = Field(0, description="Seed of the engine's deterministic choices.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Devices one simulated replica stands for (what it reserves on a cluster with GPUs)."
    )
    weight_load_ms: float = Field(
        0.0, ge=0, description="Simulated time a weight commit takes (ms): the engine generates nothing meanwhile."
    )
    request_overhead_ms: float = Field(
        0.0,
        ge=0,
        description="Time a finished request's result takes to reach its caller (ms): a real server's front "
        "end and transport, which `rollfleet calibrate` measures as its per-request overhead (18.3 ms for "
        "vLLM on CPU, vllm-cpu-tiny). The sequence's batch slot is free at once, so queued requests hide it; "
        "a caller that refills a slot only when a result arrives (late binding) waits for it. 0: none.",
    )
    max_steps_per_wake: int = Field(
        1,
        ge=1,
        description="Steps the engine may take at one wake of its loop when none of them can change the batch "
        "(a fast-forward: the same steps, settled at once; streamed requests still step one at a time). "
        "1 wakes every step; rollfleet plan uses a large value.",
    )

    def check_holds_a_sequence(self, max_model_len: int) -> None:
        """Refuse a KV cache without room for one sequence of ``max_model_len`` tokens, as vLLM
        refuses to start such a replica (its requests would be preempted forever, or end empty)."""
        usable = self.kv_capacity_tokens // self.block_size * self.block_size  # the cache is whole blocks
        if usable < max_model_len:
            raise ValueError(
                f"rollout.sim.kv_capacity_tokens ({self.kv_capacity_tokens:,}, {usable:,} in whole blocks of "
                f"{self.block_size}) holds less than one sequence of rollout.max_model_len ({max_model_len:,}) "
                "tokens: vLLM would refuse to start such a replica; raise tp, or lower the lengths"
            )

    @model_validator(mode="after")
    def _eos_in_vocabulary(self) -> "SimEngineConfig":
        if self.eos_token_id >= self.vocab_size:  # never sampled: no response would ever stop
            raise ValueError(
                f"rollout.sim.eos_token_id ({self.eos_token_id}) must be < rollout.sim.vocab_size ({self.vocab_size})"
            )
        return self


#: Server flags rollfleet sets from a typed field (the field to set instead): given again in
#: ``extra_args`` they came last and won, so a server ran at a tensor parallelism placement had not
#: reserved for, or a context the fleet's request checks did not know.
VLLM_OWNED_FLAGS: dict[str, str] = {
    "--model": "rollout.model",
    "--served-model-name": "rollout.model",
    "--max-model-len": "rollout.max_model_len",
    "--tensor-parallel-size": "rollout.vllm.tensor_parallel_size",
    "-tp": "rollout.vllm.tensor_parallel_size",
    "--max-num-seqs": "rollout.vllm.max_num_seqs",
    "--seed": "rollout.seed",
    "--dtype": "rollout.vllm.dtype",
    "--gpu-memory-utilization": "rollout.vllm.gpu_memory_utilization",
    "--host": "rollout.vllm.listen",
    "--port": "rollout.vllm.listen",
    "--uds": "rollout.vllm.listen",
}
SGLANG_OWNED_FLAGS: dict[str, str] = {
    "--model-path": "rollout.model",
    "--tp-size": "rollout.sglang.tp_size",
    "--tp": "rollout.sglang.tp_size",
    "--mem-fraction-static": "rollout.sglang.mem_fraction_static",
    "--context-length": "rollout.max_model_len",
    "--random-seed": "rollout.seed",
    "--host": "rollout.sglang (the replica picks its address)",
    "--port": "rollout.sglang (the replica picks its port)",
}


def refuse_owned_flags(args: list[str], where: str, owned: dict[str, str]) -> list[str]:
    """``args`` unless one of them is a flag rollfleet sets itself (``--flag`` or ``--flag=v``)."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise ValueError(f"{where}: {flag} is set by rollfleet from {owned[flag]}; set that instead")
    return args


class VLLMEngineConfig(_Section):
    """How a replica launches and talks to a vLLM OpenAI server on its node."""

    listen: Literal["unix", "tcp"] = Field(
        "unix",
        description=(
            "unix: the server listens on a socket in its private (0700) work dir, so nothing but its replica "
            "can call its development routes (/pause, weight updates, /collective_rpc); its /metrics and "
            "/health are served on TCP by the replica. tcp: it listens on the node's address and a free port, "
            "reachable by every process there (for tools that call the servers themselves, e.g. vllm-router)."
        ),
    )

    dtype: str = Field("auto", description="'auto' picks float32 on CPU and bfloat16 on GPU.")
    enforce_eager: bool = Field(True, description="Skip graph capture: much faster start-up on CPU.")
    kv_cache_space_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    enable_prefix_caching: bool = True
    omp_threads_bind: Optional[str] = Field(
        None, description="VLLM_CPU_OMP_THREADS_BIND; None lets rollfleet pick a core range per replica."
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="Readiness wait before start-up fails.")
    request_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="Extra CLI args for the server.")
    extra_env: dict[str, str] = Field(default_factory=dict)

    @field_validator("extra_args")
    @classmethod
    def _no_typed_flags(cls, args: list[str]) -> list[str]:
        return refuse_owned_flags(args, "rollout.vllm.extra_args", VLLM_OWNED_FLAGS)


class SGLangEngineConfig(_Section):
    """How a replica launches or reaches an SGLang server."""

    base_url: Optional[str] = Field(
        None, description="An already running SGLang server; when None, rollfleet launches one."
    )
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    startup_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    vocab_size: Optional[int] = Field(
        None,
        ge=1,
        description="Vocabulary size for input validation. SGLang's HTTP API does not report it; when "
        "None it is read from the model's config.json (local folder or Hugging Face cache).",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_typed_flags(cls, args: list[str]) -> list[str]:
        return refuse_owned_flags(args, "rollout.sglang.extra_args", SGLANG_OWNED_FLAGS)
