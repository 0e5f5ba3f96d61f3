"""A keep-mode weight commit in one call inside vLLM's API server: ``POST /rollfleet/commit``.

Why: committing staged weights in ``keep`` mode through vLLM's own routes takes five HTTP round
trips while the engine generates nothing (``/pause``, ``/start_weight_update``, one
``/update_weights`` per file, ``/finish_weight_update``, ``/resume``), and ``/pause`` adds a
fixed 20 ms sleep that lets an aborted request's last output through, which a ``keep`` pause
never has (nothing is aborted). This route makes the same engine calls back to back, in the
server: pause the scheduler (keep, KV kept), start, load each file, finish with the version
label, resume.

Installed by the replica's launch with ``--middleware rollfleet.vllm_plugin.commit.commit_route``
(vLLM adds an async function given there as HTTP middleware). The server still listens only on
its replica's private socket. Failure: before the load started, the engine is resumed and the
answer is a 500 with ``"stage": "pause"``; once it started, the model may be half-loaded, so the
engine stays paused and the answer says ``"stage": "load"`` (the caller retries the load or
restarts the server; it must not resume it).
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

#: The route this middleware answers (every other request passes through).
ROUTE = "/rollfleet/commit"
#: What the replica's launch passes to ``--middleware``.
MIDDLEWARE = "rollfleet.vllm_plugin.commit.commit_route"


async def commit_route(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    if request.url.path != ROUTE or request.method != "POST":
        return await call_next(request)
    from fastapi.responses import JSONResponse
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    try:
        body = await request.json()
        paths = [str(p) for p in body["paths"]]
        label = str(body["weight_version"])
    except Exception as exc:  # a bad body: nothing was touched
        return JSONResponse({"error": f"bad commit request: {exc!r}", "stage": "request"}, status_code=400)
    engine = request.app.state.engine_client
    started = time.monotonic()
    try:
        await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    except Exception as exc:
        await engine.resume_generation()
        return JSONResponse({"error": f"pause failed: {exc!r}", "stage": "pause"}, status_code=500)
    paused = time.monotonic()
    try:
        await engine.start_weight_update()
        for path in paths:
            await engine.update_weights(request=WeightTransferUpdateRequest(update_info={"path": path}))
        await engine.finish_weight_update(label)
    except Exception as exc:  # half-loaded: never resumed from here
        return JSONResponse({"error": f"load failed: {exc!r}", "stage": "load"}, status_code=500)
    loaded = time.monotonic()
    await engine.resume_generation()
    resumed = time.monotonic()
    return JSONResponse(
        {"pause_call_s": paused - started, "load_s": loaded - paused, "resume_call_s": resumed - loaded}
    )


__all__ = ["ROUTE", "MIDDLEWARE", "commit_route"]
