"""Output paths a command checks before it starts: a plan, a calibration or a training run that
fails to write its results after minutes of work has lost them, and a traceback from deep inside
the writer does not say which flag was wrong."""

from __future__ import annotations

import os
from pathlib import Path


def writable_dir(path: str | Path, what: str) -> Path:
    """The folder ``path``, made if missing; a ValueError naming ``what`` (the flag or config key)
    if it is a file, cannot be made, or cannot be written to."""
    folder = Path(path)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)  # it, or where it would go
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{what}: {existing} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what}: cannot make the folder {folder} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: the folder {folder} is not writable")
    return folder


def writable_file(path: str | Path, what: str) -> Path:
    """The file ``path`` (its folder made if missing); a ValueError naming ``what`` if it is a
    folder, or it or its folder cannot be written."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{what}: {file} is a folder, not a file")
    writable_dir(file.parent, what)
    if file.exists() and not os.access(file, os.W_OK):
        raise ValueError(f"{what}: {file} is not writable")
    return file


__all__ = ["writable_dir", "writable_file"]
