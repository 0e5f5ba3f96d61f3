"""How an SGLang engine loads new weights: the two phases (stage, commit) and the one-phase
``update_weights``; the weights half of :class:`~rollfleet.engines.sglang.SGLangEngine`.

* Two-phase weight updates (``update_modes``: ``abort``, and ``keep`` on servers that have it).
  :meth:`stage_weights` writes a state dict (Hugging Face names -> tensors, or pairs; a subset is
  fine) once per node into a folder on tmpfs, in a thread, while the engine keeps generating
  (:mod:`.staging`: ``<stage_dir>/<stage_key>/v<version>/model.safetensors``; replicas sharing
  ``stage_key`` reuse the file another wrote). Why a folder and a file on tmpfs: SGLang loads a
  *folder* from disk (``model_path``: every ``*.safetensors`` in it; no ``config.json`` needed, the
  model config is the booted one; ``load_weights`` takes any subset of names), and a tmpfs file is
  memory already, read through a memory map. A path is used where it is (a single ``.safetensors``
  file gets a folder of its own holding a symlink). :meth:`commit_weights` loads it with
  ``/update_weights_from_disk`` (``model_path`` = the folder, ``weight_version`` = ``str(version)``,
  ``flush_cache`` false, ``abort_all_requests`` = abort mode): ``/update_weights_from_tensor``
  would need CUDA-IPC handles from a process on the same GPUs, and the NCCL route a process group
  with the trainer, neither of which a replica has. Older staged versions are released after a
  later commit; ``shutdown`` releases what this engine holds.
* ``abort``: the caller has paused (``/pause_generation`` ``mode="abort"`` aborted everything and
  left SGLang's ``is_pause`` set, so the load runs at once instead of waiting for its writer lock);
  after the load the engine flushes the radix cache (``/flush_cache``, retried while SGLang
  answers 400 because it is not idle yet).
* ``keep`` = ``/pause_generation`` ``mode="in_place"`` -> load (``flush_cache`` false) ->
  ``/continue_generation``. ``in_place`` stops the scheduler's loop with every request where it is:
  running ones keep their KV cache and continue on the new weights (no re-prefill, the client
  sees nothing); ``retract`` would free their KV and re-prefill them on the new weights, which is
  not what ``keep`` promises. The scheduler refuses to flush while requests are frozen, so the
  radix cache keeps KV the old weights computed: every request carries ``extra_key`` = the
  engine's weight label (SGLang namespaces its radix tree by it, the mechanism behind its
  ``cache_salt``), so no request sent after a commit reuses a prefix the old weights computed;
  requests already at the server keep the namespace they came with, as kept requests keep their
  KV by design. New calls wait at the engine's gate during the commit (so they go out with the new
  label), and :meth:`pause`/:meth:`resume` wait for a commit in progress. ``keep`` needs SGLang
  >= 0.5.7 (``mode`` and ``flush_cache`` came in 0.5.6; 0.5.6 drops ``weight_version`` while
  paused; an older server takes the pause for ``abort``), read from ``/get_server_info``'s
  ``version`` at start; before start or on an older server ``update_modes`` is ``{"abort"}``.
* A failed load raises ``InvalidRequest(field="weights")`` when SGLang says it wrote nothing
  ("Failed to get weights iterator", e.g. no weight file); "Failed to update weights ... Rolling
  back" means ``load_weights`` raised midway and its rollback re-read the new path, so the weights
  are in an unknown state: the engine is marked dead (``EngineDead``) for the replica to restart
  it. In keep mode the server is continued either way (a paused SGLang would hold every request).
* Per-token versions: SGLang >= 0.5.19 answers ``meta_info.weight_versions`` spans (see
  :mod:`.wire`), filled into ``TokenOutput.token_versions`` when every label is one this engine
  committed. Exact except across a ``keep`` commit on the overlap scheduler (SGLang's default):
  there the span boundary is ``len(output_ids)`` when the scheduler handles the update, and an
  ``in_place`` pause leaves the batch whose forward was already launched unprocessed, so its token,
  sampled by the old weights, counts as new (read in the 0.5.19-0.5.23 scheduler, not observed on
  a GPU). So a request that was in flight during a ``keep``
  commit gets ``None`` (the replica marks it unknown) unless the server runs with
  ``--disable-overlap-schedule``. Older servers: ``None`` always (``meta_info.weight_version`` is
  one label per answer).
* ``update_weights(weights)`` (one phase, the caller has paused): a path -> ``/update_weights_from_disk``;
  a mapping with ``model_path`` is sent as an ``UpdateWeightFromDiskReqInput``; a state dict is
  written to a scratch folder on tmpfs, loaded, removed. Without a ``weight_version`` of the
  caller's the engine labels the load ``reload-<n>``: no version, so the tokens it samples have no
  known version (and get a fresh ``extra_key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from rollfleet.engines.base import CommitMode
from rollfleet.engines.http.inflight import InflightTable
from rollfleet.engines.http.link import ServerLink
from rollfleet.engines.sglang import wire
from rollfleet.engines.sglang.staging import Staged, StageFolders, has_weights
from rollfleet.errors import EngineDead, InvalidRequest, NotSupported, ReplicaUnavailable

if TYPE_CHECKING:
    import httpx

#: What a path given to stage_weights must be.
_WEIGHTS_PATH = "a folder with *.safetensors (or *.bin) files, or a .safetensors file"


@contextlib.contextmanager
def _state_dict_errors(weights: Any) -> Iterator[None]:
    """What writing a state dict raises for something that is none (values without a dtype,
    a dtype safetensors cannot hold) -> ``InvalidRequest`` on ``weights``."""
    try:
        yield
    except (AttributeError, TypeError, ValueError) as e:
        raise InvalidRequest("weights", "a state dict (name -> tensor, or pairs) or a path", type(weights).__name__,
                             str(e)) from e  # fmt: skip


class SGLangWeights:
    """The weights half of :class:`~rollfleet.engines.sglang.SGLangEngine` (its state is the engine's)."""

    name: ClassVar[str]
    replica_label: str
    request_timeout_s: float
    stage: StageFolders
    _staged: dict[int, Staged]
    _label: Optional[str]
    _versions: dict[str, int]
    _reloads: itertools.count
    _keep_commits: int
    _server_version: Optional[tuple[int, int, int]]
    _weights_lock: asyncio.Lock
    _table: InflightTable
    _link: ServerLink
    last_stage: dict[str, Any]
    last_commit: dict[str, Any]

    if TYPE_CHECKING:

        @property
        def update_modes(self) -> frozenset[str]: ...

        def _check_alive(self) -> None: ...

        def _release(self, hold: str) -> None: ...

        def _raise_for(self, resp: httpx.Response, op: str) -> None: ...

        async def clear_kv_cache(self) -> None: ...

        async def _control(self, method: str, path: str, *, op: str, ok: bool = True, **kw: Any) -> httpx.Response: ...

    async def stage_weights(self, weights: Any, version: int) -> None:
        """Phase 1, while generating: a state dict (name -> tensor, or an iterable of pairs; Hugging
        Face names, a subset is fine) is written once per node to ``<stage dir>/v<version>/``
        (reused if a replica sharing the stage key wrote it); a folder of weights is used where it
        is, a ``.safetensors`` file through a folder of its own; neither is ever removed. Staging
        drops what was staged before and not committed."""
        started = time.monotonic()
        staged = await asyncio.to_thread(self._stage, weights, version)
        self._drop([v for v in self._staged if v != version])
        self._staged[version] = staged
        self.last_stage = {
            "version": version, "seconds": time.monotonic() - started, "written": staged.written,
            "folder": str(staged.folder),
        }  # fmt: skip

    def _stage(self, weights: Any, version: int) -> Staged:
        """Blocking: where the commit of ``version`` will load ``weights`` from."""
        if isinstance(weights, Mapping) and isinstance(weights.get("model_path"), (str, os.PathLike)):
            weights = weights["model_path"]  # an UpdateWeightFromDiskReqInput-like spec: its path
        if not isinstance(weights, (str, os.PathLike)):
            with _state_dict_errors(weights):
                return self.stage.stage(weights, version)
        path = Path(weights)
        if path.is_dir() and has_weights(path):
            return Staged(path, owned=False)
        if path.is_file() and path.suffix == ".safetensors":
            return self.stage.stage_file(path, version)
        raise InvalidRequest("weights", _WEIGHTS_PATH, str(path))

    def drop_staged(self) -> None:
        self._drop(list(self._staged))

    def _drop(self, versions: list[int]) -> None:
        owned = [v for v in versions if v in self._staged and self._staged[v].owned]
        for v in versions:
            self._staged.pop(v, None)
        self.stage.release(owned)  # unlinks: quick enough for the event loop

    async def commit_weights(self, version: int, mode: CommitMode = "abort") -> None:
        """Phase 2: load what was staged under ``version`` (see the module docstring). ``abort``:
        the caller has paused and will resume; the engine loads, then flushes the radix cache.
        ``keep``: the engine pauses in place (in-flight requests frozen with their KV), loads,
        labels ``version``, continues. Raises ``InvalidRequest`` (field ``weights``) when SGLang
        refused the weights without touching the model, ``EngineDead`` when a load failed midway."""
        if mode not in self.update_modes:
            why = (f"SGLang {'.'.join(map(str, self._server_version)) if self._server_version else '(version unknown)'}"
                   f" cannot keep requests across a load; keep needs >= {'.'.join(map(str, wire.KEEP_SINCE))}")  # fmt: skip
            raise NotSupported(self.name, f"commit_weights(mode={mode!r})", why)
        staged = self._staged.get(version)
        if staged is None:
            raise KeyError(f"no weights staged under version {version} (staged: {sorted(self._staged)})")
        self._check_alive()
        label = str(int(version))
        body = wire.update_body(str(staged.folder), label, keep=mode == "keep")
        started = time.monotonic()
        async with self._weights_lock:
            if mode == "keep":
                timings = await self._commit_keep(body, int(version))
            else:
                await self._load(body, "commit_weights", int(version))
                timings = {"load_s": time.monotonic() - started}
        self._staged.pop(version, None)
        if mode == "abort":
            await self.clear_kv_cache()  # cached KV was computed with the old weights
        await asyncio.to_thread(self.stage.release_older, version)
        self.last_commit = {"version": version, "mode": mode, "seconds": time.monotonic() - started, **timings}

    async def _commit_keep(self, body: dict[str, Any], version: int) -> dict[str, Any]:
        """Pause in place, load, continue; new calls wait at the gate meanwhile (they go out with
        the new label). The server is continued even when the load failed: a paused SGLang holds
        every request, and a model the load did not touch serves on."""
        self._keep_commits += 1
        self._table.hold("commit")
        started, paused_at = time.monotonic(), time.time()
        paused = loaded = started
        failed = True
        try:
            await self._control("POST", "/pause_generation", op="commit_weights", json={"mode": "in_place"})
            paused = time.monotonic()
            await self._load(body, "commit_weights", version)
            loaded = time.monotonic()
            failed = False
        finally:
            try:
                await self._control("POST", "/continue_generation", op="commit_weights", json={})
            except ReplicaUnavailable:
                if not failed:
                    raise
            finally:
                self._release("commit")
        resumed = time.monotonic()
        return {"pause_s": resumed - started, "pause_call_s": paused - started, "load_s": loaded - paused,
                "continue_call_s": resumed - loaded, "window": (paused_at, time.time())}  # fmt: skip

    async def _load(self, body: dict[str, Any], op: str, version: Optional[int] = None) -> None:
        """``/update_weights_from_disk``, then the engine's label is the body's ``weight_version``
        (a known ``version`` when given); a refusal raises (see :func:`wire.load_touched_weights`)."""
        resp = await self._control("POST", "/update_weights_from_disk", op=op, ok=False, json=body,
                                   timeout=self.request_timeout_s)  # fmt: skip
        try:
            result = resp.json()
        except ValueError:
            result = None
        if resp.status_code == 400 or (isinstance(result, Mapping) and result.get("success") is False):
            message = str(result.get("message")) if isinstance(result, Mapping) else resp.text
            if wire.load_touched_weights(message):
                reason = (f"{op}: loading {body['model_path']} failed midway ({message.strip()[:300]}); "
                          "the weights are in an unknown state: restart the server")  # fmt: skip
                self._link.mark_dead(reason)
                raise EngineDead(self.replica_label, reason)
            raise InvalidRequest("weights", "a checkpoint the SGLang server can load", body["model_path"], message)
        self._raise_for(resp, op)
        label = str(body["weight_version"])
        if version is not None:
            self._versions[label] = version
        self._label = label

    async def update_weights(self, weights: Any) -> None:
        """Load new weights at once (one phase; the caller has paused): a checkpoint folder, a
        mapping with ``model_path`` (sent as an ``UpdateWeightFromDiskReqInput``), or a state dict
        (written to a scratch folder on tmpfs, loaded, removed). Labelled with the caller's
        ``weight_version``, else ``reload-<n>``: no version this engine can tell tokens by."""
        self._check_alive()
        body: Optional[dict[str, Any]] = None
        if isinstance(weights, (str, os.PathLike)):
            body = {"model_path": os.fspath(weights)}
        elif isinstance(weights, Mapping) and isinstance(weights.get("model_path"), (str, os.PathLike)):
            body = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in weights.items()}
        label = str(body["weight_version"]) if body and body.get("weight_version") is not None else None
        label = label or f"reload-{next(self._reloads)}"
        async with self._weights_lock:
            if body is not None:
                await self._load({**body, "weight_version": label}, "update_weights")
            else:
                with _state_dict_errors(weights):
                    scratch = await asyncio.to_thread(self.stage.scratch, weights)
                try:
                    await self._load({"model_path": str(scratch), "weight_version": label}, "update_weights")
                finally:
                    await asyncio.to_thread(shutil.rmtree, scratch, True)
        # The version committed last is replaced: its files are not needed any more (staged ones are).
        await asyncio.to_thread(self.stage.release, [v for v in self.stage.linked() if v not in self._staged])
