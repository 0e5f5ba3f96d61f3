"""A small fake vLLM OpenAI server (dev mode) that speaks the routes the vLLM engine uses.

The shapes are those listed in ``rollfleet/engines/vllm/wire.py`` (verified against vLLM 0.32):

* ``POST /v1/completions`` with ``prompt`` = token ids answers ``choices[0].token_ids``,
  ``choices[0].logprobs.token_logprobs`` and ``finish_reason`` ``stop | length | abort``; the request
  is registered as ``cmpl-<X-Request-Id>-0``; rejected input answers 400
  ``{"error": {"message", "type", "param", "code"}}`` ("Token id N is out of vocabulary" with no
  param, ``input_tokens`` for a prompt longer than the context, ``temperature``...);
* ``/abort_requests`` ``{"request_ids": [...]}`` aborts registered requests (unknown ids do
  nothing); an aborted request answers ``finish_reason: "abort"`` with its partial tokens;
* ``/pause?mode=abort`` aborts every registered request and queues new ones (registered, hence
  abortable, but not run) until ``/resume``;
* ``/collective_rpc`` ``reload_weights`` changes the token model's salt (``salt_for(dir)``) and
  records the tensor names it found; ``/reset_prefix_cache``, ``/sleep``, ``/wake_up``,
  ``/start_profile``, ``/stop_profile`` (404 with ``profiler=False``), ``/health``, ``/metrics``.

Knobs for fault tests: ``register_delay_s`` (a request stays unknown to the server that long after
it arrived: still on the wire, so an abort misses it), ``health_delay_s`` (a starved server),
``fail_status`` (completions answer that HTTP status), ``drop_finish_reason`` /
``finish_reason`` (what ``finish_reason`` says).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

try:
    from tests.engines.fake_server import (
        PROMPT,
        VOCAB,
        FakeServer,
        expected_tokens,
        run_generation,
        salt_for,
        token_logprob,
        wait_until,
    )
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_server import (
        PROMPT,
        VOCAB,
        FakeServer,
        expected_tokens,
        run_generation,
        salt_for,
        token_logprob,
        wait_until,
    )

_SETTINGS = dict(token_delay_s=0.0, eos_token_id=None, register_delay_s=0.0, health_delay_s=0.0, fail_status=None,
                 drop_finish_reason=False, finish_reason=None, profiler=True)  # fmt: skip


class FakeVLLMServer(FakeServer):
    def __init__(
        self, *, vocab_size: int = VOCAB, max_model_len: int = 256, model: str = "tiny", **settings: Any
    ) -> None:
        self.max_model_len = max_model_len
        self.model = model
        super().__init__(vocab_size=vocab_size)
        self.reset(**settings)

    def reset(self, **settings: Any) -> "FakeVLLMServer":
        """Back to a fresh state between tests (the server keeps running); ``settings`` override knobs."""
        self.drain()
        unknown = set(settings) - set(_SETTINGS)
        assert not unknown, f"unknown settings {unknown}"
        for key, value in {**_SETTINGS, **settings}.items():
            setattr(self, key, value)
        self.salt = 0
        self.healthy = True
        self.paused = False
        self.sleeping = False
        self.requests = []
        self.headers: list[dict[str, str]] = []  # of each completion request
        self.loaded: list[list[str]] = []  # tensor names of each reload_weights
        self.prefix_cache: set[tuple[int, ...]] = set()
        self.counters = {"prompt": 0, "generation": 0, "queries": 0, "hits": 0}
        return self

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        fake = self

        def error(message: str, param: Optional[str] = None, status: int = 400) -> JSONResponse:
            kind = "BadRequestError" if status == 400 else "InternalServerError"
            return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await fake.record(request)
            fake.headers.append(dict(request.headers))
            if fake.fail_status:
                return error("the engine broke", status=fake.fail_status)
            prompt = body.get("prompt") or []
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < fake.vocab_size]
            if bad:
                return error(f"Token id {bad[0]} is out of vocabulary")
            if len(prompt) >= fake.max_model_len:
                return error(f"This model's maximum context length is {fake.max_model_len} tokens. However, your "
                             f"prompt contains {len(prompt)} input tokens", "input_tokens")  # fmt: skip
            if (body.get("temperature") or 0.0) < 0:
                return error(f"temperature must be non-negative, got {body['temperature']}.", "temperature")
            max_tokens = body.get("max_tokens", 16)
            stop_ids = set(body.get("stop_token_ids") or [])
            if fake.eos_token_id is not None and not body.get("ignore_eos"):
                stop_ids.add(fake.eos_token_id)
            rid = f"cmpl-{request.headers.get('x-request-id') or body.get('request_id')}-0"
            await asyncio.sleep(fake.register_delay_s)  # still "on the wire": unknown to /abort_requests
            state = {"tokens": [], "logprobs": [], "abort": False, "prompt": len(prompt), "waiting": fake.paused}
            fake.running[rid] = state
            try:
                while fake.paused and not state["abort"]:  # queued by the paused scheduler
                    await asyncio.sleep(0.002)
                state["waiting"] = False
                kind, matched = await run_generation(
                    fake, state, prompt[-1], max_tokens, body.get("min_tokens") or 0, stop_ids
                )
            finally:
                fake.running.pop(rid, None)
            cached = len(prompt) if tuple(prompt) in fake.prefix_cache else 0
            fake.prefix_cache.add(tuple(prompt))
            for key, n in (
                ("prompt", len(prompt)),
                ("generation", len(state["tokens"])),
                ("queries", len(prompt)),
                ("hits", cached),
            ):
                fake.counters[key] += n
            finish = None if fake.drop_finish_reason else (fake.finish_reason or kind)
            tokens = list(state["tokens"])
            return {
                "id": rid, "object": "text_completion", "model": body.get("model"),
                "choices": [{
                    "index": 0, "text": "", "token_ids": tokens, "finish_reason": finish, "stop_reason": matched,
                    "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": list(state["logprobs"])},
                }],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                          "prompt_tokens_details": {"cached_tokens": cached}},
            }  # fmt: skip

        @app.post("/abort_requests")
        async def abort_requests(request: Request) -> dict:
            ids = (await fake.record(request) or {}).get("request_ids") or list(fake.running)
            for rid in ids:
                if rid in fake.running:
                    fake.running[rid]["abort"] = True
            return {"status": "aborted", "aborted": len(ids)}

        @app.post("/pause")
        async def pause(request: Request, mode: str = "abort", clear_cache: bool = True) -> dict:
            await fake.record(request)
            fake.paused = True
            if mode == "abort":
                while fake.running:  # abort until nothing registered is left
                    for state in list(fake.running.values()):
                        state["abort"] = True
                    await asyncio.sleep(0.002)
            return {"status": "paused"}

        @app.post("/resume")
        async def resume(request: Request) -> dict:
            await fake.record(request)
            fake.paused = False
            return {"status": "resumed"}

        @app.get("/health")
        async def health(request: Request) -> Any:
            await asyncio.sleep(fake.health_delay_s)
            return JSONResponse({}, 200 if fake.healthy else 503)

        @app.get("/metrics")
        async def metrics(request: Request) -> PlainTextResponse:
            await fake.record(request)
            waiting = sum(1 for s in fake.running.values() if s["waiting"])
            used = sum(s["prompt"] + len(s["tokens"]) for s in fake.running.values())
            samples = [
                ("gauge", "vllm:num_requests_running", len(fake.running) - waiting),
                ("gauge", "vllm:num_requests_waiting", waiting),
                ("gauge", "vllm:kv_cache_usage_perc", min(1.0, used / 10_000)),
                ("counter", "vllm:prefix_cache_queries", fake.counters["queries"]),
                ("counter", "vllm:prefix_cache_hits", fake.counters["hits"]),
                ("counter", "vllm:prompt_tokens", fake.counters["prompt"]),
                ("counter", "vllm:generation_tokens", fake.counters["generation"]),
            ]
            labels = '{engine="0",model_name="%s"}' % fake.model
            lines = []
            for kind, name, value in samples:
                suffix = "_total" if kind == "counter" else ""
                lines += [f"# HELP {name} fake", f"# TYPE {name} {kind}", f"{name}{suffix}{labels} {float(value)}"]
            lines += ["# HELP vllm:e2e_request_latency_seconds fake", "# TYPE vllm:e2e_request_latency_seconds histogram",
                      'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 1.0', "vllm:e2e_request_latency_seconds_count 1.0",
                      "vllm:e2e_request_latency_seconds_sum 0.5"]  # fmt: skip
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> Any:
            body = await fake.record(request) or {}
            path = (body.get("kwargs") or {}).get("weights_path", "")
            if body.get("method") != "reload_weights" or not os.path.isdir(path):
                return JSONResponse({"error": f"cannot reload from {path!r}"}, 500)
            from safetensors import safe_open

            names: list[str] = []
            for file in sorted(os.listdir(path)):
                if file.endswith(".safetensors"):
                    with safe_open(os.path.join(path, file), "pt") as f:
                        names += sorted(f.keys())
            fake.loaded.append(names)
            fake.salt = salt_for(os.path.realpath(path)) if names else 0
            return {"results": [None]}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> dict:
            await fake.record(request)
            fake.prefix_cache.clear()
            return {"success": True}

        @app.post("/sleep")
        async def sleep(request: Request, level: int = 1) -> dict:
            await fake.record(request)
            fake.sleeping = True
            return {"status": "sleeping", "level": level}

        @app.post("/wake_up")
        async def wake_up(request: Request) -> dict:
            await fake.record(request)
            fake.sleeping = False
            return {"status": "awake", "tags": None}

        @app.post("/start_profile")
        @app.post("/stop_profile")
        async def profile(request: Request) -> Any:
            await fake.record(request)
            return JSONResponse({}, 200) if fake.profiler else JSONResponse({"detail": "Not Found"}, 404)

        return app


if __name__ == "__main__":  # a launched "vllm.entrypoints.openai.api_server" for tests of the launch path
    FakeVLLMServer.main()

__all__ = ["FakeVLLMServer", "expected_tokens", "token_logprob", "salt_for", "wait_until", "VOCAB", "PROMPT"]
