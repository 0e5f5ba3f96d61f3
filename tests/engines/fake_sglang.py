"""A small fake SGLang HTTP server that speaks the documented native-API shapes.

It answers the routes and bodies listed in ``rollfleet/engines/sglang/`` (``engine.py`` and
``wire.py`` docstrings; taken from sgl-project/sglang ``http_server.py``, ``io_struct.py``,
``tokenizer_manager.py``), with the deterministic token model of ``fake_server.py``:

* ``max_new_tokens``, ``min_new_tokens``, ``stop_token_ids``, EOS (``eos_token_id``, unless
  ``ignore_eos``) are honoured; finish reasons are ``BaseFinishReason.to_json()`` dicts;
* ``/pause_generation`` (mode ``abort``) aborts every running request, which answers with its
  partial tokens and ``{"type": "abort"}``, and holds new ``/generate`` calls until
  ``/continue_generation``;
* ``/update_weights_from_disk`` changes the token model's salt (``salt_for(path)``);
* validation errors answer ``400 {"error": {"message": ...}}`` like ``_create_error_response``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

try:
    from tests.engines.fake_server import (
        FakeServer,
        expected_tokens,
        next_token,
        run_generation,
        salt_for,
        token_logprob,
    )
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_server import FakeServer, expected_tokens, next_token, run_generation, salt_for, token_logprob

#: SGLang ``SamplingParams`` fields (sampling_params.py); anything else is rejected like SGLang does.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed",
    }
)  # fmt: skip


class FakeSGLangServer(FakeServer):
    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        context_length: int = 4096,
        token_delay_s: float = 0.0,
        eos_token_id: Optional[int] = None,
        metrics_enabled: bool = True,
        model_path: str = "fake/model",
        max_total_num_tokens: int = 100_000,
    ) -> None:
        self.context_length = context_length
        self.eos_token_id = eos_token_id
        self.metrics_enabled = metrics_enabled
        self.model_path = model_path
        self.max_total_num_tokens = max_total_num_tokens
        self.weight_version = "default"
        self.healthy = True
        #: When True, /generate answers ``finish_reason: null`` (to test the engine's fallback).
        self.drop_finish_reason = False
        self.asleep = False
        self.profiling = False
        self.flushes = 0
        self.held: set[str] = set()
        super().__init__(vocab_size=vocab_size, token_delay_s=token_delay_s)

    def drain(self, timeout_s: float = 2.0) -> None:
        super().drain(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.held and time.monotonic() < deadline:
            time.sleep(0.005)

    def reset(self, **settings: Any) -> "FakeSGLangServer":
        """Back to a fresh state between tests (the server keeps running); ``settings`` override
        the constructor's knobs (``token_delay_s``, ``metrics_enabled``...)."""
        self.drain()
        defaults = dict(token_delay_s=0.0, eos_token_id=None, metrics_enabled=True, model_path="fake/model")
        defaults.update(settings)
        for key, value in defaults.items():
            setattr(self, key, value)
        self.weight_version = "default"
        self.salt = 0
        self.healthy = True
        self.drop_finish_reason = False
        self.requests = []
        self.paused = False
        self.asleep = False
        self.profiling = False
        self.flushes = 0
        return self

    # ------------------------------------------------------------------ the app

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        fake = self
        record = self.record

        def error(message: str, status: int = 400) -> JSONResponse:
            return JSONResponse({"error": {"message": message}}, status_code=status)

        @app.get("/health")
        @app.get("/health_generate")
        async def health(request: Request) -> Response:
            await record(request)
            return Response(status_code=200 if fake.healthy else 503)

        @app.get("/get_model_info")
        @app.get("/model_info")
        async def model_info(request: Request) -> dict:
            await record(request)
            return {
                "model_path": fake.model_path,
                "tokenizer_path": fake.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": fake.weight_version,
            }

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def server_info(request: Request) -> dict:
            await record(request)
            return {
                "model_path": fake.model_path,
                "context_length": fake.context_length,
                "max_total_num_tokens": fake.max_total_num_tokens,
                "max_req_input_len": fake.context_length - 1,
                "status": "ready",
                "internal_states": [{}],
                "version": "0.0.0-fake",
            }

        @app.get("/get_load")
        async def get_load(request: Request) -> list:
            await record(request)
            used = sum(s["prompt"] + len(s["tokens"]) for s in fake.running.values())
            return [
                {
                    "dp_rank": 0,
                    "num_reqs": len(fake.running) + len(fake.held),
                    "num_waiting_reqs": len(fake.held),
                    "num_tokens": used,
                }
            ]

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            await record(request)
            if not fake.metrics_enabled:  # SGLang mounts /metrics only with --enable-metrics
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            used = sum(s["prompt"] + len(s["tokens"]) for s in fake.running.values())
            labels = '{model_name="%s",engine_type="unified"}' % fake.model_path
            lines = []
            for name, value in (
                ("sglang:num_running_reqs", len(fake.running)),
                ("sglang:num_queue_reqs", len(fake.held)),
                ("sglang:num_used_tokens", used),
                ("sglang:token_usage", used / fake.max_total_num_tokens),
            ):
                lines += [f"# HELP {name} fake", f"# TYPE {name} gauge", f"{name}{labels} {float(value)}"]
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request) -> Any:
            body = await record(request)
            if not isinstance(body, dict):
                return error("request body must be a JSON object")
            input_ids = body.get("input_ids")
            if not input_ids:
                return error("At least one of text, input_ids, or image should be provided")
            if any((not isinstance(t, int)) or t < 0 or t >= fake.vocab_size for t in input_ids):
                return error(f"The input_ids contain token ids outside the vocabulary [0, {fake.vocab_size}).")
            if len(input_ids) >= fake.context_length:
                return error(
                    f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                    f"({fake.context_length} tokens)."
                )
            sp = dict(body.get("sampling_params") or {})
            unknown = set(sp) - SAMPLING_KEYS
            if unknown:
                return error(f"Unexpected sampling parameters: {sorted(unknown)}")
            temperature = sp.get("temperature", 1.0)
            if temperature is not None and temperature < 0:
                return error(f"temperature must be a non-negative finite number, got {temperature}.")
            top_p = sp.get("top_p", 1.0)
            if top_p is not None and not 0.0 < top_p <= 1.0:
                return error(f"top_p must be in (0, 1], got {top_p}.")
            max_new = sp.get("max_new_tokens", 128)
            if max_new is None:
                max_new = 128
            if max_new < 0:
                return error(f"max_new_tokens must be at least 0, got {max_new}.")
            min_new = sp.get("min_new_tokens", 0) or 0
            stop_ids = set(sp.get("stop_token_ids") or [])
            if fake.eos_token_id is not None and not sp.get("ignore_eos", False):
                stop_ids.add(fake.eos_token_id)
            rid = body.get("rid") or f"auto-{len(fake.requests)}"
            if rid in fake.running or rid in fake.held:
                return error(f"Duplicate request ID detected: {rid}")

            # TokenizerManager.generate_request waits on is_pause_cond before registering the rid.
            if fake.paused:
                fake.held.add(rid)
                try:
                    while fake.paused:
                        await asyncio.sleep(0.002)
                finally:
                    fake.held.discard(rid)

            state = {"tokens": [], "logprobs": [], "abort": False, "prompt": len(input_ids)}
            fake.running[rid] = state
            try:
                kind, matched = await run_generation(fake, state, input_ids[-1], max_new, min_new, stop_ids)
            finally:
                fake.running.pop(rid, None)
            if kind == "abort":
                finish: dict[str, Any] = {
                    "type": "abort",
                    "message": "Aborted" if state["tokens"] else "Abort before prefill",
                    "status_code": None,
                    "err_type": None,
                }
            elif kind == "length":
                finish = {"type": "length", "length": max_new}
            else:
                finish = {"type": "stop", "matched": matched}

            meta: dict[str, Any] = {
                "id": rid,
                "finish_reason": None if fake.drop_finish_reason else finish,
                "prompt_tokens": len(input_ids),
                "weight_version": fake.weight_version,
                "completion_tokens": len(state["tokens"]),
                "cached_tokens": 0,
                "e2e_latency": 0.0,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(state["logprobs"], state["tokens"])]
            return {"text": "", "output_ids": list(state["tokens"]), "meta_info": meta}

        @app.post("/abort_request")
        async def abort_request(request: Request) -> Response:
            body = await record(request) or {}
            if body.get("abort_all"):
                for state in fake.running.values():
                    state["abort"] = True
            elif body.get("rid") in fake.running:
                fake.running[body["rid"]]["abort"] = True
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request) -> JSONResponse:
            body = await record(request) or {}
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                return error(f"Invalid mode: {mode!r}.")
            fake.paused = True
            if mode == "abort":
                while fake.running:  # like TokenizerManager: abort until nothing is left
                    for state in fake.running.values():
                        state["abort"] = True
                    await asyncio.sleep(0.002)
            return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

        @app.post("/continue_generation")
        async def continue_generation(request: Request) -> JSONResponse:
            await record(request)
            fake.paused = False
            return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(request: Request) -> Response:
            await record(request)
            if fake.running or fake.held:
                return Response(content="Cache not flushed: requests are running.\n", status_code=400)
            fake.flushes += 1
            return Response(
                content="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n",
                status_code=200,
            )

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> JSONResponse:
            body = await record(request) or {}
            path = body.get("model_path")
            if not isinstance(path, str) or not os.path.exists(path):
                return JSONResponse(
                    {
                        "success": False,
                        "message": f"Failed to get weights iterator: {path} not found.",
                        "num_paused_requests": 0,
                    },
                    status_code=400,
                )
            fake.salt = salt_for(path)
            fake.model_path = path
            if body.get("weight_version") is not None:
                fake.weight_version = body["weight_version"]
            return JSONResponse(
                {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
            )

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        async def release_memory_occupation(request: Request) -> Any:
            await record(request)
            fake.asleep = True
            return None

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def resume_memory_occupation(request: Request) -> Any:
            await record(request)
            fake.asleep = False
            return None

        @app.api_route("/start_profile", methods=["GET", "POST"])
        async def start_profile(request: Request) -> Response:
            await record(request)
            fake.profiling = True
            return Response(content="Start profiling.\n", status_code=200)

        @app.api_route("/stop_profile", methods=["GET", "POST"])
        async def stop_profile(request: Request) -> Response:
            await record(request)
            fake.profiling = False
            return Response(content="Stop profiling. This will take some time.\n", status_code=200)

        return app


if __name__ == "__main__":  # a launched "sglang.launch_server" for tests of the launch path
    FakeSGLangServer.main()

__all__ = ["FakeSGLangServer", "expected_tokens", "next_token", "token_logprob", "salt_for"]
