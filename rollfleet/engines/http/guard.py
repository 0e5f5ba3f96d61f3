"""The parent guard: a server never outlives the replica process that launched it.

A server runs in its own session (see :mod:`.process`), so nothing kills it when the replica
process dies; ``shutdown`` and the atexit hook cover a replica that exits, not one that is
SIGKILLed. The guard covers that case: it is written as ``sitecustomize.py`` into a folder on the
server's PYTHONPATH, so that it runs in every Python process of the server (API server, vLLM's
EngineCore and workers, SGLang's scheduler and detokenizer): a daemon thread checks once a second
that the launching process is alive and, when it is gone (even SIGKILLed), kills the server's whole
process group. vLLM's EngineCore does not notice its API server dying, so without this a killed
replica leaves EngineCore and workers running forever.

Traded away: a server environment with its own ``sitecustomize`` on PYTHONPATH has it shadowed
by ours. The pid is checked together with its start time, so a reused pid does not keep a server
alive.
"""

from __future__ import annotations

import os
from pathlib import Path

GUARD_SOURCE = r"""
import os as _os


def _rollfleet_guard():
    import signal, threading, time

    pid = int(_os.environ.get("ROLLFLEET_GUARD_PID") or 0)
    start = _os.environ.get("ROLLFLEET_GUARD_START") or ""
    if pid <= 0:
        return
    use_proc = _os.path.exists("/proc/self/stat")

    def alive():
        if use_proc:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                return False
            return fields[0] not in ("Z", "X") and (not start or fields[19] == start)
        try:
            _os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except OSError:
            return True

    def watch():
        while alive():
            time.sleep(1.0)
        try:
            _os.killpg(_os.getpgrp(), signal.SIGKILL)
        finally:
            _os._exit(1)

    threading.Thread(target=watch, name="rollfleet-parent-guard", daemon=True).start()


_rollfleet_guard()
"""


def proc_start_time(pid: int) -> str:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks): tells a pid from its reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def install_guard(env: dict[str, str], site_dir: Path) -> None:
    """Write the guard into ``site_dir`` and point ``env`` (the server's) at it and at this process."""
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(GUARD_SOURCE)
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["ROLLFLEET_GUARD_PID"] = str(os.getpid())
    env["ROLLFLEET_GUARD_START"] = proc_start_time(os.getpid())


__all__ = ["GUARD_SOURCE", "install_guard", "proc_start_time"]
