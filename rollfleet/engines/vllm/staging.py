"""Where a two-phase weight update puts its weights between the phases: node-local safetensors
files that vLLM's workers read through the ``rollfleet_tmpfs`` backend (:mod:`rollfleet.vllm_plugin`).

Layout: ``<root>/<key>/v<version>.safetensors``. ``root`` defaults to ``/dev/shm`` (tmpfs: the file
is memory, and a worker's memory map of it costs no disk read); ``key`` names the fleet, so that
the replicas of one fleet on one node share each file: the first one to stage a version writes it
(under a temporary name, then ``os.replace``: a file under the final name is always complete),
the others find it and reuse it. The replica keeps generating meanwhile: the writing is plain,
blocking file I/O that the engine runs in a thread.

Who removes a shared file: each engine that stages a version holds its own hard link to it,
``v<version>.safetensors.<owner>``, and loads from that link. Releasing a version (after a newer
commit, at shutdown) removes the engine's link, then the shared name once no other engine links
it (``st_nlink == 1``): one replica restarting mid-update never pulls a file from under the
others, and the memory is freed when the last replica is done with it. A replica process killed
outright leaves its links behind: the links of a version whose owner process is gone are swept
when that version is staged again or an older one released.

The writer, :func:`write_safetensors`, is shared with SGLang's staging
(:mod:`rollfleet.engines.http.staging`); it streams a tensor at a time.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rollfleet.engines.http.staging import check_stage_key, default_root, tensors_of, write_safetensors

#: ``v<version>.safetensors`` (a staged version's shared name), or ``...safetensors.<owner>`` (a link).
_NAME = re.compile(r"^v(\d+)\.safetensors(?:\.(.+))?$")


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a path given by the user: the file itself, or a folder's
    ``*.safetensors`` (sorted). Raise ValueError for anything else."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.safetensors") if f.is_file())
        if not files:
            raise ValueError(f"no *.safetensors in {p}")
        return files
    if p.is_file() and p.suffix == ".safetensors":
        return [p]
    raise ValueError(f"{p} is neither a folder nor a .safetensors file")


@dataclass
class Staged:
    """What a commit of one version loads: ``files``, in order. ``owned``: links this engine
    holds in its stage dir (released later); else paths the user gave (never removed)."""

    files: list[Path]
    owned: bool
    #: Bytes this engine wrote (0 when it reused a file another replica wrote, or the user's).
    written: int = 0
    #: Seconds the writing took (in its thread).
    write_s: float = 0.0


class StageDir:
    """One engine's view of ``<root>/<key>``; blocking file operations (run them in a thread)."""

    def __init__(self, root: str | os.PathLike[str], key: str, owner: Optional[str] = None) -> None:
        self.path = Path(root) / check_stage_key(key)
        self.owner = owner or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def shared(self, version: int) -> Path:
        return self.path / f"v{int(version)}.safetensors"

    def link(self, version: int) -> Path:
        return self.path / f"v{int(version)}.safetensors.{self.owner}"

    def stage(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> Staged:
        """Write ``weights`` as version ``version`` unless a replica sharing the key already did;
        return this engine's link to it."""
        items = tensors_of(weights)  # once: a retry below must not write a used-up iterable (nothing)
        self.path.mkdir(parents=True, exist_ok=True)
        shared, mine = self.shared(version), self.link(version)
        self._sweep_dead(version)  # a file only dead replicas link is not this update's
        self._sweep_dead_writes()
        written, started = 0, time.monotonic()
        for _ in range(3):  # the shared name can vanish between our check and our link (its last user released it)
            if not shared.exists():
                tmp = self.path / f".v{int(version)}.{self.owner}.{uuid.uuid4().hex[:6]}.tmp"
                try:
                    written = write_safetensors(items, tmp)
                    os.replace(tmp, shared)  # atomic: the final name only ever names a complete file
                finally:
                    tmp.unlink(missing_ok=True)
            try:
                mine.unlink(missing_ok=True)  # staged twice: link the current file
                os.link(shared, mine)
                return Staged([mine], owned=True, written=written, write_s=time.monotonic() - started)
            except FileNotFoundError:
                continue
        raise OSError(f"could not stage version {version} in {self.path}")

    def release(self, versions: Iterable[int]) -> None:
        """Drop this engine's links to ``versions``, and each shared file no one links any more."""
        for version in versions:
            self.link(version).unlink(missing_ok=True)
            self._drop_unused(self.shared(version))

    def release_older(self, version: int) -> list[int]:
        """After a commit of ``version``: release every older version in the folder (this engine's
        links, and the shared files no other engine still links); return the versions seen."""
        seen = [v for v in self._versions(mine=False) if v < version]
        for old in seen:
            self._sweep_dead(old)
        self.release(seen)
        return seen

    def _sweep_dead(self, version: int) -> None:
        """Remove the links of ``version`` whose owner process is gone (a replica killed before it
        released them), and the shared file if no one else links it. Kept, a file of a failed
        update was reused as is when the update was tried again under the same version with other
        weights, and tmpfs never got its memory back."""
        prefix = f"v{int(version)}.safetensors."
        try:
            names = [n for n in os.listdir(self.path) if n.startswith(prefix)]
        except FileNotFoundError:
            return
        for name in names:
            pid = name[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                (self.path / name).unlink(missing_ok=True)
        self._drop_unused(self.shared(version))

    def _sweep_dead_writes(self) -> None:
        """Remove half-written files (``.v<N>.<pid>-<id>.<id>.tmp``) of processes that are gone: a
        replica killed while it wrote (its stage timed out, it was restarted) never reached its
        ``finally``, and tmpfs held up to a whole model's copy until the node rebooted."""
        try:
            names = [n for n in os.listdir(self.path) if n.startswith(".v") and n.endswith(".tmp")]
        except FileNotFoundError:
            return
        for name in names:
            parts = name.split(".")
            pid = parts[2].split("-", 1)[0] if len(parts) > 2 else ""
            if pid.isdigit() and not _alive(int(pid)):
                (self.path / name).unlink(missing_ok=True)

    def linked(self) -> list[int]:
        """The versions this engine holds a link to."""
        return self._versions(mine=True)

    def release_all(self) -> None:
        """At shutdown: release every version this engine links; remove the folder once empty."""
        self.release(self.linked())
        try:
            self.path.rmdir()
        except OSError:
            pass  # still used by another replica of the fleet (or never made)

    def _versions(self, mine: bool) -> list[int]:
        """Versions this engine links (``mine``), or every version in the folder plus those."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        found = set()
        for m in map(_NAME.match, names):
            if m and (m.group(2) == self.owner or (not mine and m.group(2) is None)):
                found.add(int(m.group(1)))
        return sorted(found)

    @staticmethod
    def _drop_unused(shared: Path) -> None:
        try:
            if shared.stat().st_nlink <= 1:
                shared.unlink(missing_ok=True)
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this node (a stage folder is node-local)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["StageDir", "Staged", "default_root", "tensors_of", "weight_files", "write_safetensors"]
