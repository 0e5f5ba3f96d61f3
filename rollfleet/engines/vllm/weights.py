"""How a vLLM engine loads new weights: two phases on a server with the RL routes, one without.

``update_modes`` ``abort`` and ``keep`` (with the RL routes; see :mod:`.engine`):

* :meth:`~VLLMWeights.stage_weights`, while the engine keeps generating: a state dict is written
  once per node to a tmpfs file (:mod:`.staging`), in a thread; a path given by the user is used
  where it is;
* :meth:`~VLLMWeights.commit_weights` loads the staged files: ``POST /start_weight_update``, one
  ``POST /update_weights {"update_info": {"path": FILE}}`` per file (rollfleet's
  ``rollfleet_tmpfs`` backend reads it with safetensors, straight into vLLM's layerwise reload), then
  ``POST /finish_weight_update {"weight_version": "<version>"}``, which labels every token sampled
  from then on. ``keep`` brackets that with ``POST /pause?mode=keep&clear_cache=false`` and ``POST
  /resume`` (all of it one ``POST /rollfleet/commit`` where the server has rollfleet's commit
  route, :mod:`rollfleet.vllm_plugin.commit`: no HTTP round trip and no fixed sleep between the
  steps while the engine generates nothing): in-flight requests are frozen with their KV cache
  (``clear_cache=true`` would preempt them and recompute it) and continue on the new weights; new calls wait at the engine's own gate
  meanwhile, so that they go out salted with the new label. ``abort``: the caller has paused
  (``mode=abort``) and resumes; the prefix cache is reset after the load.

Between start and finish the model's layers are on the meta device: any forward pass, hence a
``/resume`` there, kills the server. So nothing resumes in between (a lock keeps ``resume`` and
``pause`` out until the load is done), each step goes out on a fresh connection (after a 500 vLLM
drops the connection it answered on), a failed step is retried once as a whole
start/update/finish, and a second failure marks the engine dead (the replica restarts it) instead
of resuming. After a commit the stage files of older versions are released; shutdown releases
the engine's own.

Without the RL routes (a server someone else runs), and for :meth:`~VLLMWeights.update_weights`
(one phase): ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
reloads the safetensors files of DIR in place (``{"results": [null]}``). It leaves vLLM's weight
label alone, so on a server with the RL routes the engine then sets a label of its own
(``/update_weight_version``) that is no version: those tokens' versions are unknown to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from rollfleet.engines.base import CommitMode
from rollfleet.engines.http.inflight import InflightTable
from rollfleet.engines.http.link import ServerLink
from rollfleet.engines.vllm.staging import Staged, StageDir, weight_files, write_safetensors
from rollfleet.errors import EngineDead, NotSupported, ReplicaUnavailable
from rollfleet.vllm_plugin.commit import ROUTE as COMMIT_ROUTE

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

#: Weight loads take longer than a control call.
SLOW_CONTROL_S = 300.0
#: Commit calls leave no connection in the pool: after an error answer vLLM closes the connection it
#: answered on, and the next step of a commit must not be the one to find out. (A call that meets
#: a pooled connection closed under it for any other reason is sent once more:
#: :meth:`~rollfleet.engines.http.transport.HTTPClients.request`.)
FRESH_CONNECTION = {"Connection": "close"}


class VLLMWeights:
    """The weights half of :class:`~rollfleet.engines.vllm.VLLMEngine` (its state is the engine's)."""

    name: ClassVar[str]
    replica_label: str
    control_timeout_s: float
    rl_routes: bool
    stage: StageDir
    _staged: dict[int, Staged]
    _label: str
    _reloads: itertools.count
    _weights_lock: asyncio.Lock
    _table: InflightTable
    _link: ServerLink
    last_stage: dict[str, Any]
    last_commit: dict[str, Any]
    #: Whether to try the server's one-call commit route (off once the server says it has none).
    _commit_route: bool = True

    if TYPE_CHECKING:

        @property
        def update_modes(self) -> frozenset[str]: ...

        def _check_alive(self) -> None: ...

        def _release(self, hold: str) -> None: ...

        async def _control(self, method: str, path: str, *, op: str, ok: bool = True, **kw: Any) -> httpx.Response: ...

        async def clear_kv_cache(self) -> None: ...

    # ------------------------------------------------------------------ the two phases
    async def stage_weights(self, weights: Any, version: int) -> None:
        """Phase 1, while generating: a state dict (name -> tensor, or an iterable of pairs; Hugging
        Face names, a subset is fine) is written once per node to ``<stage dir>/v<version>.safetensors``
        (reused if a replica sharing the stage key wrote it); a ``.safetensors`` file or a folder
        of them is used where it is, and never removed. Staging drops what was staged before."""
        started = time.monotonic()
        if isinstance(weights, (str, os.PathLike)):
            staged = Staged(await asyncio.to_thread(weight_files, weights), owned=False)
        else:
            staged = await asyncio.to_thread(self.stage.stage, weights, version)
        dropped = [v for v in self._staged if v != version]
        self._drop([v for v in dropped if self._staged[v].owned])
        self._staged = {version: staged}
        self.last_stage = {
            "version": version,
            "seconds": time.monotonic() - started,
            "bytes": sum(f.stat().st_size for f in staged.files),
            "written": staged.written,
            "write_s": staged.write_s,
            "files": [str(f) for f in staged.files],
        }

    def drop_staged(self) -> None:
        self._drop([v for v, s in self._staged.items() if s.owned])
        self._staged.clear()

    def _drop(self, versions: list[int]) -> None:
        for v in versions:
            self._staged.pop(v, None)
        self.stage.release(versions)  # unlinks: quick enough for the event loop

    async def commit_weights(self, version: int, mode: CommitMode = "abort") -> None:
        """Phase 2: load what was staged under ``version`` (see the module docstring for the
        routes). ``keep``: the engine pauses (freezing its in-flight requests), loads, labels
        ``version`` and resumes; ``abort``: the caller has paused and will resume. Raises
        ``EngineDead`` when the load failed twice: the model is then half-loaded and the server
        must be restarted (it is not resumed)."""
        if mode not in self.update_modes:
            raise NotSupported(self.name, f"commit_weights(mode={mode!r})", f"modes: {sorted(self.update_modes)}")
        staged = self._staged.get(version)
        if staged is None:
            raise KeyError(f"no weights staged under version {version} (staged: {sorted(self._staged)})")
        self._check_alive()
        async with self._weights_lock:
            if not self.rl_routes:
                started = time.monotonic()
                await self._reload(staged.files)
                self.last_commit = {"version": version, "mode": mode, "load_s": time.monotonic() - started}
            elif mode == "keep":
                await self._commit_keep(staged.files, version)
            else:
                started = time.monotonic()
                await self._load(staged.files, str(version))
                self.last_commit = {"version": version, "mode": mode, "load_s": time.monotonic() - started}
        self._staged.pop(version, None)
        if not self.rl_routes or mode == "abort":
            await self._reset_prefix_cache()
        if staged.owned:
            await asyncio.to_thread(self.stage.release_older, version)

    async def _commit_keep(self, files: list[Path], version: int) -> None:
        """Pause (keep, KV kept), load, label, resume; new calls wait at the gate meanwhile: in one
        call to the server's commit route where it has one (:mod:`rollfleet.vllm_plugin.commit`),
        else through the RL routes step by step."""
        self._table.hold("commit")
        try:
            started, paused_at = time.monotonic(), time.time()
            steps = await self._commit_in_server(files, version) if self._commit_route else None
            if steps is None:
                steps = await self._commit_by_steps(files, version)
            resumed, resumed_at = time.monotonic(), time.time()
        finally:
            self._release("commit")
        self.last_commit = {"version": version, "mode": "keep", "pause_s": resumed - started,
                            **steps, "window": (paused_at, resumed_at)}  # fmt: skip

    async def _commit_in_server(self, files: list[Path], version: int) -> Optional[dict[str, Any]]:
        """One ``POST /rollfleet/commit``; the server's timings, or None when nothing was loaded
        and the step-by-step path must do it (no such route: remembered; or the pause failed, and
        the server resumed). A load that failed in the server is retried step by step (the engine
        is paused and must not resume half-loaded)."""
        body = {"paths": [str(f) for f in files], "weight_version": str(version)}
        timeout = max(self.control_timeout_s, 2 * SLOW_CONTROL_S)
        try:
            resp = await self._control("POST", COMMIT_ROUTE, op="commit_weights", ok=False, json=body,
                                       timeout=timeout, headers=FRESH_CONNECTION)  # fmt: skip
        except ReplicaUnavailable as e:  # no answer: how far did it get?
            logger.warning(
                "%s: commit call for %s got no answer (%s); checking the server", self.replica_label, version, e
            )
            if await self._is_paused():
                return await self._finish_in_steps(files, version)
            if await self._server_label() == str(version):
                self._label = str(version)
                return {"load_s": float("nan"), "commit": "route"}  # it loaded; when is unknown
            return None
        if resp.status_code == 200:
            self._label = str(version)
            return {**resp.json(), "commit": "route"}
        if resp.status_code == 404:
            self._commit_route = False
            return None
        stage = (resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}).get(
            "stage"
        )
        logger.warning(
            "%s: commit route failed (HTTP %d, %s): %s", self.replica_label, resp.status_code, stage, resp.text[:300]
        )
        return await self._finish_in_steps(files, version) if stage == "load" else None

    async def _finish_in_steps(self, files: list[Path], version: int) -> dict[str, Any]:
        """The server is paused with the load perhaps half done: load again, then resume."""
        return {**await self._load_and_resume(files, version), "commit": "route, then steps"}

    async def _commit_by_steps(self, files: list[Path], version: int) -> dict[str, Any]:
        started = time.monotonic()
        try:
            await self._control("POST", "/pause", op="commit_weights",
                                params={"mode": "keep", "clear_cache": "false"})  # fmt: skip
        except ReplicaUnavailable:
            await self._resume_quietly()  # nothing was started: resuming is safe
            raise
        paused_s = time.monotonic() - started
        return {"pause_call_s": paused_s, **await self._load_and_resume(files, version), "commit": "steps"}

    async def _load_and_resume(self, files: list[Path], version: int) -> dict[str, float]:
        """On a paused server: load ``version`` (see :meth:`_load`), then resume; what each took."""
        started = time.monotonic()
        await self._load(files, str(version))
        loaded = time.monotonic()
        await self._resume_loaded()
        return {"load_s": loaded - started, "resume_call_s": time.monotonic() - loaded}

    async def _is_paused(self) -> bool:
        resp = await self._control("GET", "/is_paused", op="commit_weights", headers=FRESH_CONNECTION)
        return bool(resp.json().get("is_paused"))

    async def _server_label(self) -> Optional[str]:
        resp = await self._control("GET", "/weight_info", op="commit_weights", headers=FRESH_CONNECTION)
        label = resp.json().get("weight_version")
        return None if label is None else str(label)

    async def _load(self, files: list[Path], label: str) -> None:
        """start, update per file, finish (labelling ``label``); once more as a whole if a step
        failed; then the engine is dead (never resumed half-loaded)."""
        timeout = max(self.control_timeout_s, 2 * SLOW_CONTROL_S)
        errors: list[ReplicaUnavailable] = []
        for attempt in (1, 2):
            try:
                await self._rl_call("/start_weight_update", None, timeout)
                for f in files:
                    await self._rl_call("/update_weights", {"update_info": {"path": str(f)}}, timeout)
                await self._rl_call("/finish_weight_update", {"weight_version": label}, timeout)
                self._label = label
                return
            except EngineDead:
                raise
            except ReplicaUnavailable as e:
                logger.warning("%s: weight update %s failed (try %d of 2): %s", self.replica_label, label, attempt, e)
                errors.append(e)
        # Both causes: the first is what went wrong; the second is often only its echo (vLLM keeps
        # an update it did not finish active, so the retry's start is refused as "already active").
        reason = (f"commit_weights: loading weights {label} failed twice (first: {errors[0]}; then: {errors[-1]}); "
                  "the model is half-loaded and the server must not run again: restart it")  # fmt: skip
        self._link.mark_dead(reason)
        raise EngineDead(self.replica_label, reason) from errors[0]

    async def _rl_call(self, path: str, body: Optional[dict[str, Any]], timeout: float) -> None:
        await self._control("POST", path, op="commit_weights", json=body, timeout=timeout, headers=FRESH_CONNECTION)

    async def _resume_loaded(self) -> None:
        """Resume once the load finished (safe now): tried twice, each on a fresh connection."""
        for attempt in (1, 2):
            try:
                await self._rl_call("/resume", None, self.control_timeout_s)
                return
            except EngineDead:
                raise
            except ReplicaUnavailable:
                if attempt == 2:
                    raise

    async def _resume_quietly(self) -> None:
        try:
            await self._control("POST", "/resume", op="commit_weights", ok=False)
        except ReplicaUnavailable:
            pass

    async def _reset_prefix_cache(self) -> None:
        """Cached KV was computed with the old weights. Requests salted with the weights' label
        (the RL routes) never reach it: best effort, a busy engine may refuse. Unsalted ones (an
        attached server) would: there a refusal, after retries, fails the commit (the replica is
        fenced and restarted), where it used to be dropped unread."""
        if not self.rl_routes:
            await self.clear_kv_cache()
            return
        try:
            await self._control("POST", "/reset_prefix_cache", op="clear_kv_cache", ok=False)
        except ReplicaUnavailable:
            pass

    async def weights_checksum(self) -> Optional[str]:
        """One SHA-256 over vLLM's own per-parameter checksums (``POST /weight_checker
        {"action": "checksum"}``, gathered from every worker), None without the RL routes. On the
        CPU build vLLM repacks linear-layer weights and leaves their parameters empty, so there the
        digest sees the embeddings, norms and ``lm_head`` only (docs/vllm-rl-api-on-cpu.md, section
        3); GPU builds checksum every parameter."""
        if not self.rl_routes:
            return None
        resp = await self._control("POST", "/weight_checker", op="weights_checksum", json={"action": "checksum"})
        checksums = resp.json().get("checksums") or {}
        digest = hashlib.sha256()
        for name in sorted(checksums):
            digest.update(f"{name}={checksums[name]}\n".encode())
        return digest.hexdigest()

    async def update_weights(self, weights: Any) -> None:
        """Load new weights at once (one phase, through ``reload_weights``): a state dict (name ->
        tensor, or an iterable of pairs), a ``.safetensors`` file, or a folder of
        ``*.safetensors``. Names are those of the Hugging Face checkpoint
        (``model.layers.0.self_attn.q_proj.weight``...); a subset is fine. The caller has paused."""
        self._check_alive()
        async with self._weights_lock:
            if isinstance(weights, (str, os.PathLike)) and Path(weights).is_dir():  # noqa: ASYNC240
                await self._reload_dir(str(weights))
            elif isinstance(weights, (str, os.PathLike)):
                await self._reload(weight_files(weights))
            else:
                tmp = await asyncio.to_thread(self._scratch_dir)
                try:
                    await asyncio.to_thread(write_safetensors, weights, tmp / "model.safetensors")
                    await self._reload_dir(str(tmp))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            if self.rl_routes:
                # reload_weights keeps vLLM's label; these weights are no committed version.
                label = f"reload-{next(self._reloads)}"
                await self._control("POST", "/update_weight_version", op="update_weights", json={"new_version": label})
                self._label = label
        await self._reset_prefix_cache()
        # The version committed last is replaced: its file is not needed any more (staged ones are).
        await asyncio.to_thread(self.stage.release, [v for v in self.stage.linked() if v not in self._staged])

    def _scratch_dir(self) -> Path:
        """A temporary folder next to the stage dir (tmpfs where there is one)."""
        self.stage.path.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="reload-", dir=self.stage.path.parent))

    async def _reload(self, files: list[Path]) -> None:
        """``reload_weights`` of ``files``: linked into a folder of their own (it loads a folder)."""
        tmp = await asyncio.to_thread(self._scratch_dir)
        try:
            for i, f in enumerate(files):
                os.symlink(Path(f).resolve(), tmp / f"{i:04d}.safetensors")  # noqa: ASYNC240
            await self._reload_dir(str(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def _reload_dir(self, weights_dir: str) -> None:
        await self._control(
            "POST", "/collective_rpc", op="update_weights",
            json={"method": "reload_weights", "kwargs": {"weights_path": weights_dir}},
            timeout=max(self.control_timeout_s, 2 * SLOW_CONTROL_S),
        )  # fmt: skip


__all__ = ["VLLMWeights", "SLOW_CONTROL_S", "FRESH_CONNECTION"]
