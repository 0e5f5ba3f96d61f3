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

The RL API of a server launched with ``--enable-scale-out`` and ``--weight-transfer-config``
(``docs/vllm-rl-api-on-cpu.md``; the real one answers errors 500 and closes the connection, so
does this one):

* ``POST /inference/v1/generate`` ``{"token_ids", "sampling_params": {...}, "cache_salt",
  "priority"}``: registered as ``generate-tokens-<X-Request-Id>``; answers ``choices[0]``
  ``token_ids``, ``logprobs.content[i].logprob``, ``finish_reason``, ``stop_reason`` and
  ``weight_versions`` spans (the label current when each token was made); errors as vLLM's (400:
  ``param`` ``temperature``, ``body.token_ids``, or null with "Token id N is out of vocabulary" /
  "The decoder prompt (length N) is longer than the maximum model length"); stop strings need
  ``detokenize``; the prefix cache is keyed by ``cache_salt`` and prompt;
* ``/pause?mode=keep`` freezes the running requests (no token is made until ``/resume``) and
  queues new ones; ``mode=abort`` aborts them (as above);
* ``/start_weight_update``, ``/update_weights {"update_info": {"path": FILE}}``,
  ``/finish_weight_update {"weight_version"}``: a session (start twice, update or finish without
  start: 500); finish installs a salt made of the files' real paths and the label. **A forward
  pass between start and finish kills the engine** (as the real one: the layers are on the meta
  device): the fake is then ``crashed`` and answers every call 500. ``/update_weights`` failing
  (``fail_updates`` knob, or a missing file) ends the session, as vLLM's does;
* ``/update_weight_version {"new_version"}``, ``GET /weight_info``, ``POST /weight_checker
  {"action": "checksum"}`` (per-parameter digests of the current salt).

``log`` lists the RL events in order (``pause mode=keep clear_cache=false``, ``start``,
``update <path>``, ``finish <label>``, ``resume``, ``reset_prefix_cache``...).

Knobs for fault tests: ``register_delay_s`` (a request stays unknown to the server that long after
it arrived: still on the wire, so an abort misses it), ``health_delay_s`` (a starved server),
``fail_status`` (completions answer that HTTP status), ``drop_finish_reason`` /
``finish_reason`` (what ``finish_reason`` says), ``fail_updates`` (that many next
``/update_weights`` fail), ``update_delay_s`` (each ``/update_weights`` takes that long),
``commit_route`` (answer rollfleet's ``/rollfleet/commit``, else 404 as a plain vLLM does),
``refuse_resets`` (that many next ``/reset_prefix_cache`` answer 200 ``{"success": false}``).
"""

from __future__ import annotations

import asyncio
import hashlib
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
        next_token,
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
        next_token,
        run_generation,
        salt_for,
        token_logprob,
        wait_until,
    )

_SETTINGS = dict(token_delay_s=0.0, eos_token_id=None, register_delay_s=0.0, health_delay_s=0.0, fail_status=None,
                 drop_finish_reason=False, finish_reason=None, profiler=True, fail_updates=0,
                 update_delay_s=0.0, commit_route=False, refuse_resets=0)  # fmt: skip


def spans(labels: list[str]) -> list[dict[str, Any]]:
    """vLLM's ``weight_versions``: one span per run of equal labels, over output-token indexes."""
    out: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if out and out[-1]["version"] == label:
            out[-1]["end"] = i + 1
        else:
            out.append({"version": label, "start": i, "end": i + 1})
    return out


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
        self.prefix_cache: set[tuple[Any, ...]] = set()
        self.counters = {"prompt": 0, "generation": 0, "queries": 0, "hits": 0}
        self.weight_version = "default"  # vLLM's label of the weights
        self.frozen = False  # /pause?mode=keep: running requests make no token
        self.updating = False  # between /start_weight_update and /finish_weight_update
        self.session: list[str] = []  # files loaded in the current update session
        self.updates: list[tuple[str, list[str]]] = []  # (label, tensor names) of each finished update
        self.crashed: Optional[str] = None
        self.log: list[str] = []
        return self

    def crash(self, reason: str) -> None:
        """The engine died (a forward pass on meta tensors): every call is answered 500 from now on."""
        if self.crashed is None:
            self.crashed = reason
            self.log.append(f"crashed: {reason}")

    async def run_rl(self, state: dict[str, Any], last: int, max_new: int, min_new: int,
                     stop_ids: set[int]) -> tuple[str, Optional[int]]:  # fmt: skip
        """As ``run_generation``, for the RL route: frozen while paused in keep mode, each token
        labelled with the weights that made it, and a step during a weight update kills the engine."""
        while True:
            if self.crashed:
                return "crashed", None
            if state["abort"]:
                return "abort", None
            if len(state["tokens"]) >= max_new:
                return "length", None
            await asyncio.sleep(self.token_delay_s)
            if state["abort"] or self.crashed:
                continue
            if self.frozen:
                await asyncio.sleep(0.002)
                continue
            if self.updating:
                self.crash("a forward pass ran between /start_weight_update and /finish_weight_update")
                continue
            last = next_token(last, self.salt, self.vocab_size)
            state["tokens"].append(last)
            state["logprobs"].append(token_logprob(last))
            state["versions"].append(self.weight_version)
            if last in stop_ids and len(state["tokens"]) >= min_new:
                return "stop", last

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        fake = self

        def error(message: str, param: Optional[str] = None, status: int = 400) -> JSONResponse:
            kind = "BadRequestError" if status == 400 else "InternalServerError"
            # vLLM's RL routes raise through to Starlette: the connection is closed after a 500
            headers = {"Connection": "close"} if status >= 500 else None
            return JSONResponse(
                {"error": {"message": message, "type": kind, "param": param, "code": status}}, status, headers=headers
            )

        def worker_error(message: str) -> JSONResponse:
            return error(f"Call to collective_rpc method failed: Worker failed with error '{message}'", status=500)

        def dead() -> Optional[JSONResponse]:
            return error(f"EngineCore encountered a fatal error: {fake.crashed}", status=500) if fake.crashed else None

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Any:
            body = await fake.record(request)
            fake.headers.append(dict(request.headers))
            if fake.crashed:
                return dead()
            if fake.fail_status:
                return error("the engine broke", status=fake.fail_status)
            prompt = body.get("token_ids") or []
            if not prompt:
                return error("1 validation error:\n  {'type': 'too_short', 'loc': 'body.token_ids', 'msg': "
                             "'List should have at least 1 item after validation, not 0'}", "body.token_ids")  # fmt: skip
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < fake.vocab_size]
            if bad:
                return error(f"Token id {bad[0]} is out of vocabulary")
            if len(prompt) > fake.max_model_len:
                return error(f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length "
                             f"of {fake.max_model_len}.")  # fmt: skip
            sp = body.get("sampling_params") or {}
            if (sp.get("temperature") or 0.0) < 0:
                t = sp["temperature"]
                return error(
                    f"temperature must be non-negative, got {t}. (parameter=temperature, value={t})", "temperature"
                )
            if sp.get("stop") and sp.get("detokenize") is False:
                return error(
                    "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
                )
            stop_ids = set(sp.get("stop_token_ids") or [])
            if fake.eos_token_id is not None and not sp.get("ignore_eos"):
                stop_ids.add(fake.eos_token_id)
            rid = f"generate-tokens-{request.headers.get('x-request-id') or body.get('request_id')}"
            await asyncio.sleep(fake.register_delay_s)  # still "on the wire": unknown to /abort_requests
            state = {"tokens": [], "logprobs": [], "versions": [], "abort": False, "prompt": len(prompt),
                     "waiting": fake.paused}  # fmt: skip
            fake.running[rid] = state
            try:
                while fake.paused and not state["abort"] and not fake.crashed:  # queued by the paused scheduler
                    await asyncio.sleep(0.002)
                state["waiting"] = False
                kind, matched = await fake.run_rl(
                    state, prompt[-1], sp.get("max_tokens", 16), sp.get("min_tokens") or 0, stop_ids
                )
            finally:
                fake.running.pop(rid, None)
            if kind == "crashed":
                return dead()
            key = (body.get("cache_salt"), *prompt)
            cached = len(prompt) if key in fake.prefix_cache else 0
            fake.prefix_cache.add(key)
            for name, n in (("prompt", len(prompt)), ("generation", len(state["tokens"])), ("queries", len(prompt)),
                            ("hits", cached)):  # fmt: skip
                fake.counters[name] += n
            finish = None if fake.drop_finish_reason else (fake.finish_reason or kind)
            tokens = list(state["tokens"])
            return {
                "request_id": rid, "model": fake.model, "output_mode": "tokens",
                "choices": [{
                    "index": 0, "finish_reason": finish, "stop_reason": matched, "token_ids": tokens,
                    "weight_versions": spans(state["versions"]),
                    "logprobs": {"content": [{"token_id": t, "logprob": lp, "rank": 1,
                                              "top_logprobs": [{"token_id": t, "logprob": lp, "rank": 1}]}
                                             for t, lp in zip(tokens, state["logprobs"])]},
                }],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                          "prompt_tokens_details": {"cached_tokens": cached}},
            }  # fmt: skip

        @app.post("/start_weight_update")
        async def start_weight_update(request: Request) -> Any:
            await fake.record(request)
            if fake.crashed:
                return dead()
            if fake.updating:
                return worker_error("start_weight_update called while a weight update is already active. "
                                    "Call finish_weight_update first.")  # fmt: skip
            fake.updating, fake.session = True, []
            fake.log.append("start")
            return {"message": "Weight update started"}

        @app.post("/update_weights")
        async def update_weights(request: Request) -> Any:
            body = await fake.record(request) or {}
            if fake.crashed:
                return dead()
            if "update_info" not in body:
                return error("[{'loc': 'body.update_info', 'msg': 'Field required'}]", "body.update_info")
            if not fake.updating:
                return worker_error("start_weight_update must be called before update_weights.")
            path = (body["update_info"] or {}).get("path", "")
            fake.log.append(f"update {path}")
            await asyncio.sleep(fake.update_delay_s)
            if fake.fail_updates or not os.path.isfile(path):
                fake.fail_updates = max(0, fake.fail_updates - 1)
                fake.updating = False  # as vLLM: the session ends, the model stays on meta tensors
                return worker_error(f"No such file or directory: {path}")
            fake.session.append(path)
            return {"message": "Weights updated"}

        @app.post("/finish_weight_update")
        async def finish_weight_update(request: Request) -> Any:
            body = await fake.record(request) or {}
            if fake.crashed:
                return dead()
            if not fake.updating:
                return worker_error("finish_weight_update called without a matching start_weight_update.")
            finish_session(body.get("weight_version") or fake.weight_version)
            return {"message": "Weight update finished"}

        def finish_session(label: str) -> None:
            from safetensors import safe_open

            names: list[str] = []
            for path in fake.session:
                with safe_open(path, "pt") as f:
                    names += sorted(f.keys())
            if fake.session:
                fake.salt = salt_for("|".join(os.path.realpath(p) for p in fake.session))
            fake.weight_version, fake.updating = label, False
            fake.updates.append((label, names))
            fake.log.append(f"finish {label}")

        @app.post("/rollfleet/commit")
        async def rollfleet_commit(request: Request) -> Any:
            """rollfleet.vllm_plugin.commit's route (``commit_route`` on): the keep commit in one call."""
            body = await fake.record(request) or {}
            if not fake.commit_route:
                return JSONResponse({"detail": "Not Found"}, 404)
            if fake.crashed:
                return dead()
            fake.log.append("commit route")
            fake.paused = fake.frozen = True
            fake.updating, fake.session = True, []
            for path in body["paths"]:
                await asyncio.sleep(fake.update_delay_s)
                if fake.fail_updates or not os.path.isfile(path):
                    fake.fail_updates = max(0, fake.fail_updates - 1)
                    fake.updating = False  # paused, half-loaded: the route does not resume
                    return JSONResponse({"error": f"load failed: {path}", "stage": "load"}, 500)
                fake.session.append(path)
            finish_session(str(body["weight_version"]))
            fake.paused = fake.frozen = False
            return {"pause_call_s": 0.0, "load_s": 0.001, "resume_call_s": 0.0}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request) -> Any:
            body = await fake.record(request) or {}
            fake.weight_version = body["new_version"]
            fake.log.append(f"label {fake.weight_version}")
            return {"success": True, "new_version": fake.weight_version}

        @app.get("/weight_info")
        async def weight_info(request: Request) -> Any:
            await fake.record(request)
            return {"weight_version": fake.weight_version}

        @app.post("/weight_checker")
        async def weight_checker(request: Request) -> Any:
            body = await fake.record(request) or {}
            if body.get("action") != "checksum":
                return error(f"unsupported action {body.get('action')!r}", "action")
            digest = hashlib.sha256(str(fake.salt).encode()).hexdigest()
            return {"checksums": {"dp0:pp0:pcp0:tp0:model.embed_tokens.weight": digest,
                                  "dp0:pp0:pcp0:tp0:model.norm.weight": digest[::-1]}}  # fmt: skip

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
        async def pause(request: Request, mode: str = "abort", clear_cache: bool = True) -> Any:
            await fake.record(request)
            if fake.crashed:
                return dead()
            fake.log.append(f"pause mode={mode} clear_cache={str(clear_cache).lower()}")
            fake.paused = True
            fake.frozen = mode == "keep"
            if mode == "abort":
                while fake.running:  # abort until nothing registered is left
                    for state in list(fake.running.values()):
                        state["abort"] = True
                    await asyncio.sleep(0.002)
            return {"status": "paused"}

        @app.post("/resume")
        async def resume(request: Request) -> Any:
            await fake.record(request)
            if fake.crashed:
                return dead()
            fake.log.append("resume")
            fake.paused = fake.frozen = False  # during a weight update: the next step kills the engine
            return {"status": "resumed"}

        @app.get("/health")
        async def health(request: Request) -> Any:
            await asyncio.sleep(fake.health_delay_s)
            return JSONResponse({}, 200 if fake.healthy and not fake.crashed else 503)

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
            fake.log.append("reset_prefix_cache")
            if fake.refuse_resets:  # blocks still held: vLLM says so in a 200
                fake.refuse_resets -= 1
                return {"success": False}
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

__all__ = ["FakeVLLMServer", "expected_tokens", "token_logprob", "salt_for", "wait_until", "spans", "VOCAB", "PROMPT"]
