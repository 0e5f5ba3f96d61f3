"""A small fake SGLang HTTP server that speaks the documented native-API shapes.

It answers the routes and bodies listed in ``rollfleet/engines/sglang/`` (``engine.py`` and
``wire.py`` docstrings; taken from sgl-project/sglang ``http_server.py``, ``io_struct.py``,
``tokenizer_manager.py``), with the deterministic token model of ``fake_server.py``:

* ``max_new_tokens``, ``min_new_tokens``, ``stop_token_ids``, EOS (``eos_token_id``, unless
  ``ignore_eos``) are honoured; finish reasons are ``BaseFinishReason.to_json()`` dicts;
* ``version`` (what ``/get_server_info`` reports, default ``"0.5.23"``) decides which SGLang it
  plays, release by release as read in sglang's sources: ``/pause_generation`` ``mode`` is honoured
  from 0.5.6 (before, every pause aborts); ``flush_cache`` of a weight update from 0.5.6 (before,
  the load always flushes); a refused flush after a load answers ``success: false`` from 0.5.22
  (before, the scheduler's ``assert`` kills the server: 500, unhealthy); a load while paused
  updates the label from 0.5.7; ``meta_info.weight_versions`` spans from 0.5.19;
* ``/pause_generation``: ``abort`` aborts every running request, which answers with its partial
  tokens and ``{"type": "abort"}``; every mode holds new ``/generate`` calls (TokenizerManager's
  ``is_pause``) until ``/continue_generation``; ``in_place`` freezes running requests where they
  are (no token is made, their state is kept); ``retract`` freezes them too and counts a retraction
  (their KV would be recomputed: ``meta_info.num_retractions``);
* ``/update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``; a missing ``model_path`` is a
  400, unknown keys are ignored) loads like ``DefaultModelLoader``: ``model_path`` must be a folder
  (anything else would be a Hugging Face repo id), holding ``*.safetensors`` (else ``*.bin``);
  none: ``"Failed to get weights iterator: Cannot find any model weights with ..."`` and the
  weights untouched; a file whose safetensors header does not parse fails midway (``"Failed to
  update weights: ... Rolling back to original weights."``). Not paused, it waits for the running
  requests like SGLang's writer lock (new ones wait behind it); ``abort_all_requests`` aborts them
  first. A load changes the token model's salt (``salt_for(model_path)``), records the tensor
  names it read (``loads``), moves the scheduler's label (the ``weight_versions`` spans of live
  requests keep what they made before) and, if the load succeeded, the server's label; then
  ``flush_cache`` (default true) flushes, which SGLang refuses while requests are running;
* ``/flush_cache`` is refused (400) while requests are running (not counting the ones a ``retract``
  pause moved back to waiting, nor calls held before the scheduler);
* validation errors answer ``400 {"error": {"message": ...}}`` like ``_create_error_response``.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import struct
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

try:
    from tests.engines.fake_server import FakeServer, expected_tokens, next_token, salt_for, token_logprob
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    from fake_server import FakeServer, expected_tokens, next_token, salt_for, token_logprob

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


def version_tuple(version: str) -> tuple[int, int, int]:
    parts = [int(p) for p in version.split(".")[:3] if p.isdigit()]
    return (parts + [0, 0, 0])[0], (parts + [0, 0, 0])[1], (parts + [0, 0, 0])[2]


def weight_version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict[str, Any]]:
    """SGLang's ``compute_weight_version_spans``: ``events`` are (label before a change, output
    tokens made by then); the last span runs under ``current`` to ``n``."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def safetensors_names(path: str) -> list[str]:
    """The tensor names of a safetensors file (its header); ValueError if it is not one."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from e
    return sorted(k for k in header if k != "__metadata__")


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
        version: str = "0.5.23",
        disable_overlap_schedule: bool = False,
    ) -> None:
        self.context_length = context_length
        self.eos_token_id = eos_token_id
        self.metrics_enabled = metrics_enabled
        self.model_path = model_path
        self.max_total_num_tokens = max_total_num_tokens
        self.version = version
        self.disable_overlap_schedule = disable_overlap_schedule
        self.held: set[str] = set()
        super().__init__(vocab_size=vocab_size, token_delay_s=token_delay_s)
        self._fresh()

    def _fresh(self) -> None:
        self.weight_version = "default"  # TokenizerManager's label (model_info, meta_info without spans)
        self.scheduler_version = "default"  # the scheduler's label (the spans)
        self.salt = 0
        self.healthy = True
        #: When True, /generate answers ``finish_reason: null`` (to test the engine's fallback).
        self.drop_finish_reason = False
        self.requests = []
        self.paused = False  # TokenizerManager.is_pause: new /generate calls wait
        self.engine_paused = False  # the scheduler's loop is stopped (in_place / retract)
        self.writers = 0  # updates waiting for / holding the writer lock
        self.asleep = False
        self.profiling = False
        self.flushes = 0
        self.loads: list[tuple[str, list[str]]] = []  # (model_path, tensor names) of each load that ran
        self.log: list[str] = []  # control events in order ("pause in_place", "load v1", "continue"...)

    def features(self) -> tuple[int, int, int]:
        return version_tuple(self.version)

    def release_all(self) -> None:
        super().release_all()
        self.engine_paused = False

    def drain(self, timeout_s: float = 2.0) -> None:
        super().drain(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.held and time.monotonic() < deadline:
            time.sleep(0.005)

    def reset(self, **settings: Any) -> "FakeSGLangServer":
        """Back to a fresh state between tests (the server keeps running); ``settings`` override
        the constructor's knobs (``token_delay_s``, ``metrics_enabled``, ``version``...)."""
        self.drain()
        defaults = dict(token_delay_s=0.0, eos_token_id=None, metrics_enabled=True, model_path="fake/model",
                        version="0.5.23", disable_overlap_schedule=False)  # fmt: skip
        defaults.update(settings)
        for key, value in defaults.items():
            setattr(self, key, value)
        self._fresh()
        return self

    async def run(self, state: dict[str, Any], last: int, max_new: int, min_new: int,
                  stop_ids: set[int]) -> tuple[str, Optional[int]]:  # fmt: skip
        """The scheduler's view of one request: a token every ``token_delay_s`` while the loop runs
        (none while paused in place or retracted), until the budget, a stop id or an abort."""
        while True:
            if state["abort"]:
                return "abort", None
            if len(state["tokens"]) >= max_new:
                return "length", None
            await asyncio.sleep(self.token_delay_s)
            if state["abort"]:
                continue
            if self.engine_paused:
                await asyncio.sleep(0.002)
                continue
            last = next_token(last, self.salt, self.vocab_size)
            state["tokens"].append(last)
            state["logprobs"].append(token_logprob(last))
            if last in stop_ids and len(state["tokens"]) >= min_new:
                return "stop", last

    def request(self, request_id: str) -> Any:
        """The running state of the caller's ``request_id`` (rollfleet sends ``<id>@<unique>``),
        or None."""
        for rid, state in self.running.items():
            if rid == request_id or rid.rsplit("@", 1)[0] == request_id:
                return state
        return None

    def idle(self) -> bool:
        """The scheduler's ``is_fully_idle(ignore_waiting=paused)``: no running request (those a
        retract moved back to waiting count only while the loop is paused)."""
        return all(s["retracted"] and self.engine_paused for s in self.running.values())

    def load(self, path: Any) -> tuple[bool, str]:
        """``ModelRunner.update_weights_from_disk`` through ``DefaultModelLoader``."""
        if not isinstance(path, str) or not os.path.isdir(path):
            return False, f"Failed to get weights iterator: {path!r} is not a local folder and no such repo exists."
        files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or sorted(glob.glob(os.path.join(path, "*.bin")))
        if not files:
            return False, f"Failed to get weights iterator: Cannot find any model weights with `{path}`."
        names: list[str] = []
        try:
            for f in files:
                names += safetensors_names(f) if f.endswith(".safetensors") else []
        except (OSError, ValueError) as e:
            self.salt = salt_for(path)  # some parameters were written before it failed
            return False, f"Failed to update weights: {e}.\nRolling back to original weights."
        self.salt = salt_for(path)
        self.loads.append((path, names))
        return True, "Succeeded to update model weights."

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
                "disable_overlap_schedule": fake.disable_overlap_schedule,
                "version": fake.version,
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
            extra_key = body.get("extra_key")
            if extra_key is not None and not isinstance(extra_key, str):
                return error("extra_key should be a string for a single request.")
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
            while fake.writers:  # then model_update_lock.reader_lock: a weight update goes first
                await asyncio.sleep(0.002)

            state = {"tokens": [], "logprobs": [], "abort": False, "prompt": len(input_ids), "events": [],
                     "retracted": False, "retractions": 0}  # fmt: skip
            fake.running[rid] = state
            try:
                kind, matched = await fake.run(state, input_ids[-1], max_new, min_new, stop_ids)
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
                "num_retractions": state["retractions"],
                "completion_tokens": len(state["tokens"]),
                "cached_tokens": 0,
                "e2e_latency": 0.0,
            }
            if fake.features() >= (0, 5, 19):  # add_weight_versions_to_meta_info
                spans = weight_version_spans(state["events"], fake.scheduler_version, len(state["tokens"]))
                meta["weight_versions"] = spans
                meta["weight_version"] = spans[-1]["version"]
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(state["logprobs"], state["tokens"])]
            return {"text": "", "output_ids": list(state["tokens"]), "meta_info": meta}

        @app.post("/abort_request")
        async def abort_request(request: Request) -> Response:
            body = await record(request) or {}
            if body.get("abort_all"):
                for state in fake.running.values():
                    state["abort"] = True
            elif body.get("rid"):  # as SGLang's scheduler: every request whose rid starts with it
                for rid, state in fake.running.items():
                    if rid.startswith(body["rid"]):
                        state["abort"] = True
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request) -> JSONResponse:
            body = await record(request) or {}
            mode = body.get("mode", "abort") if fake.features() >= (0, 5, 6) else "abort"  # no mode before 0.5.6
            if mode not in ("abort", "retract", "in_place"):
                return error(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
            fake.log.append(f"pause {mode}")
            fake.paused = True
            if mode == "abort":
                while fake.running:  # like TokenizerManager: abort until nothing is left
                    for state in fake.running.values():
                        state["abort"] = True
                    await asyncio.sleep(0.002)
            else:
                fake.engine_paused = True
                if mode == "retract":  # back to the waiting queue, KV freed
                    for state in fake.running.values():
                        state["retracted"] = True
                        state["retractions"] += 1
            return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

        @app.post("/continue_generation")
        async def continue_generation(request: Request) -> JSONResponse:
            await record(request)
            fake.log.append("continue")
            fake.paused = fake.engine_paused = False
            for state in fake.running.values():
                state["retracted"] = False
            return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(request: Request) -> Response:
            await record(request)
            if not fake.idle():
                return Response(content="Flush cache failed.\n", status_code=400)
            fake.flushes += 1
            fake.log.append("flush")
            return Response(
                content="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n",
                status_code=200,
            )

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> JSONResponse:
            body = await record(request)
            if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
                return error("model_path: Field required")
            features = fake.features()
            if body.get("abort_all_requests"):
                for state in fake.running.values():
                    state["abort"] = True
            paused = fake.paused
            if not paused:  # model_update_lock.writer_lock: wait for the running requests
                fake.writers += 1
            try:
                while not paused and fake.running:
                    await asyncio.sleep(0.002)
                path = body["model_path"]
                fake.log.append(f"load {body.get('weight_version')}")
                success, message = fake.load(path)
                if success:
                    fake.model_path = path
                    label = body.get("weight_version")
                    if label is not None and label != fake.scheduler_version and features >= (0, 5, 19):
                        for state in fake.running.values():  # record_weight_version_events
                            if state["tokens"]:
                                state["events"].append((fake.scheduler_version, len(state["tokens"])))
                    if label is not None:
                        fake.scheduler_version = label
                    flush = body.get("flush_cache", True) if features >= (0, 5, 6) else True
                    if flush:
                        if fake.idle():
                            fake.flushes += 1
                        elif features >= (0, 5, 22):
                            success, message = (
                                False,
                                (
                                    "Weights were updated, but the cache was not flushed because requests are still "
                                    "running or queued. Retract or finish them, then call /flush_cache."
                                ),
                            )
                        else:  # assert flush_cache_success: the scheduler is gone
                            fake.healthy = False
                            return JSONResponse({"detail": "scheduler died"}, status_code=500)
                    if success and label is not None and (not paused or features >= (0, 5, 7)):
                        fake.weight_version = label
                        message += f" Weight version updated to {label}."
            finally:
                if not paused:
                    fake.writers -= 1
            return JSONResponse(
                {"success": success, "message": message, "num_paused_requests": 0}, status_code=200 if success else 400
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

__all__ = ["FakeSGLangServer", "expected_tokens", "next_token", "token_logprob", "salt_for", "weight_version_spans"]
