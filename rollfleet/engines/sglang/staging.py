"""Where a two-phase weight update puts SGLang's weights between the phases: one folder per
version, which ``/update_weights_from_disk`` loads as its ``model_path``.

Why a folder per version (and not vLLM's file per version, :mod:`rollfleet.engines.vllm.staging`):
SGLang loads a *folder*. ``DefaultModelLoader._prepare_weights`` takes ``model_path`` as a local
checkpoint only when ``os.path.isdir`` holds (else it tries a Hugging Face download) and loads every
``*.safetensors`` in it (``glob``; ``*.bin`` when there is none), filtered by a
``model.safetensors.index.json`` only if the folder has one; ``config.json`` is not read (the model
config is the one the server booted with), and ``model.load_weights`` takes the names it is given,
so a subset of the weights is fine (``python/sglang/srt/model_loader/loader.py`` and
``model_executor/model_runner_components/weight_updater.py``, sglang 0.5.23). Two versions in one
folder would both be loaded.

Layout, under ``<root>/<key>/`` (``root``: ``/dev/shm/rollfleet-weights`` where ``/dev/shm`` is
writable, else the temp dir; ``key``: shared by the replicas of one fleet, so that those on one
node write each version once):

* ``v<version>/model.safetensors``: the state dict of that version, written by the first replica
  that stages it under a temporary name (``.model.*.tmp``, which no glob of SGLang's matches) and
  then ``os.replace``d: the final name only ever names a complete file. Replicas staging at once
  take turns on an ``flock`` of the folder, so the others wait for that file and reuse it rather
  than each writing a copy of the model into memory;
* ``v<version>/model.safetensors.<owner>``: each staging engine's hard link to it (not a
  ``*.safetensors`` name either). Releasing a version removes the engine's link, then the shared
  name once no other engine links it (``st_nlink == 1``), then the folder once empty: one replica
  never pulls a file from under another, and the tmpfs memory is freed with the last user;
* ``f<version>.<owner>/model.safetensors``: a symlink to a single ``.safetensors`` file the user
  gave (SGLang needs a folder); the user's file itself is never removed.

All of it is blocking file I/O: the engine runs it in a thread, so generation goes on meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rollfleet.engines.http.staging import check_stage_key, default_root, tensors_of, write_safetensors

#: The one weight file of a staged version's folder.
WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_FILE_DIR = re.compile(r"^f(\d+)\.(.+)$")


def has_weights(folder: Path) -> bool:
    """Whether SGLang would find weights in ``folder`` (``*.safetensors``, else ``*.bin``)."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


@dataclass
class Staged:
    """What a commit of one version loads: ``folder`` (SGLang's ``model_path``). ``owned``: it is
    in this engine's stage dir (released later); else a folder the user gave (never removed)."""

    folder: Path
    owned: bool
    #: Bytes this engine wrote (0 when it reused a file another replica wrote, or the user's).
    written: int = 0


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` itself (no lock file to clean up); FileNotFoundError
    when the folder is gone."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class StageFolders:
    """One engine's view of ``<root>/<key>``; blocking file operations (run them in a thread)."""

    def __init__(self, root: str | os.PathLike[str], key: str, owner: Optional[str] = None) -> None:
        self.path = Path(root) / check_stage_key(key)
        self.owner = owner or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def folder(self, version: int) -> Path:
        return self.path / f"v{int(version)}"

    def link(self, version: int) -> Path:
        return self.folder(version) / f"{WEIGHTS_FILE}.{self.owner}"

    def stage(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int) -> Staged:
        """Write ``weights`` (Hugging Face names -> tensors) as version ``version``, unless a replica
        sharing the key already did; link it for this engine; return the folder to load."""
        items = tensors_of(weights)
        folder = self.folder(version)
        shared, mine = folder / WEIGHTS_FILE, self.link(version)
        for _ in range(3):  # the folder can vanish between our mkdir and our lock: its last user released it
            folder.mkdir(parents=True, exist_ok=True)
            try:
                with _locked(folder):  # replicas staging at once: one writes, the others wait and link
                    written = 0
                    if not shared.exists():
                        tmp = folder / f".model.{self.owner}.{uuid.uuid4().hex[:6]}.tmp"
                        try:
                            written = write_safetensors(items, tmp)
                            os.replace(tmp, shared)  # atomic: the final name only ever names a complete file
                        finally:
                            tmp.unlink(missing_ok=True)
                    mine.unlink(missing_ok=True)  # staged twice: link the current file
                    os.link(shared, mine)
                    return Staged(folder, owned=True, written=written)
            except FileNotFoundError:
                continue
        raise OSError(f"could not stage version {version} in {folder}")

    def stage_file(self, file: Path, version: int) -> Staged:
        """A single ``.safetensors`` file of the user's, in a folder of this engine's own (symlinked)."""
        folder = self.path / f"f{int(version)}.{self.owner}"
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / WEIGHTS_FILE
        link.unlink(missing_ok=True)
        link.symlink_to(file.resolve())
        return Staged(folder, owned=True)

    def scratch(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Path:
        """A folder of this engine's own holding ``weights`` (a one-phase load; the caller removes it)."""
        folder = self.path / f"reload-{self.owner}-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        try:
            write_safetensors(weights, folder / WEIGHTS_FILE)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def release(self, versions: Iterable[int]) -> None:
        """Drop this engine's hold on ``versions``: its links, each shared file no one links any
        more, the folders left empty."""
        for version in versions:
            folder = self.folder(version)
            try:
                with _locked(folder):
                    self.link(version).unlink(missing_ok=True)
                    shared = folder / WEIGHTS_FILE
                    if shared.exists() and shared.stat().st_nlink <= 1:
                        shared.unlink()
            except FileNotFoundError:
                pass
            self._rmdir(folder)
            mine = self.path / f"f{int(version)}.{self.owner}"
            (mine / WEIGHTS_FILE).unlink(missing_ok=True)
            self._rmdir(mine)

    def release_older(self, version: int) -> list[int]:
        """After a commit of ``version``: release every older version in the folder (this engine's
        links, and the files no other engine links); return the versions seen."""
        seen = [v for v in self._versions(mine=False) if v < version]
        self.release(seen)
        return seen

    def linked(self) -> list[int]:
        """The versions this engine holds (a link, or a folder of its own)."""
        return self._versions(mine=True)

    def release_all(self) -> None:
        """At shutdown: release every version this engine holds; remove the key folder once empty."""
        self.release(self.linked())
        self._rmdir(self.path)

    def _versions(self, mine: bool) -> list[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        found = set()
        for name in names:
            m = _VERSION_DIR.match(name)
            if m and (not mine or self.link(int(m.group(1))).exists()):
                found.add(int(m.group(1)))
            f = _FILE_DIR.match(name)
            if f and f.group(2) == self.owner:
                found.add(int(f.group(1)))
        return sorted(found)

    @staticmethod
    def _rmdir(folder: Path) -> None:
        try:
            folder.rmdir()
        except OSError:
            pass  # still used by another replica of the fleet (or never made)


__all__ = ["StageFolders", "Staged", "WEIGHTS_FILE", "default_root", "has_weights"]
