"""One supervised server process: spawned in its own session, watched, and killed as a group.

Why a subprocess per engine and not the engine in-process: a crash, an OOM kill or a hang in the
server (and in the processes it starts: vLLM's EngineCore and workers, SGLang's scheduler) cannot
take the replica (a Ray actor) down with it, and a kill is survivable and observable: the engine
sees the process exit (:meth:`ServerProcess.watch`) and its connections drop, reports
``EngineDead`` within a bounded time instead of hanging, and the manager restarts it.

Four layers make sure nothing is orphaned:

* the server leads its own process group (``start_new_session``), so :meth:`ServerProcess.kill`
  reaches every process it started (and, one by one, those that left the group);
* an atexit hook kills the groups still registered when the replica process exits without a
  shutdown (under Ray, a killed worker's children are also reaped by Ray itself);
* the parent guard (:mod:`.guard`) in every server process kills the group when the replica
  process is gone, even SIGKILLed;
* the watcher kills the group when the server's leading process exits (killed, crashed): what it
  started would otherwise go on without it.

Each launch gets a work dir (``rollfleet-<label>-*`` under the temp dir, mode 0700) holding the
server's log, the guard and, for a server on a private socket, the socket; the engine removes it at
shutdown unless it holds something worth keeping (traces).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Awaitable, Callable, Optional

from rollfleet.engines.http.guard import install_guard
from rollfleet.errors import EngineDead

#: Lines of the server log quoted when it fails.
LOG_TAIL_LINES = 60
#: How often the watcher looks at the process.
WATCH_INTERVAL_S = 0.2
#: After a connection error: how long a killed server may take to show as exited (it closes its
#: sockets a moment before it can be reaped).
EXIT_GRACE_S = 2.0
#: Pause between two readiness probes.
READY_POLL_S = 0.5
#: After SIGKILL: how long to wait for the server's processes to be gone.
KILL_WAIT_S = 5.0

#: Longest Unix socket path that fits ``sockaddr_un`` on Linux and macOS, with room to spare.
MAX_SOCKET_PATH = 100

#: Process groups of running servers, killed at interpreter exit if nobody shut them down.
_LIVE_GROUPS: set[int] = set()


@atexit.register
def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        _signal_group(pgid, signal.SIGKILL)
    _LIVE_GROUPS.clear()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the server binds it a moment later: see the retry in start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerStartupError(EngineDead):
    """The server did not come up (exited or timed out); the message holds its log tail."""


class ServerProcess:
    """One server process in its own session, with its work dir and log."""

    def __init__(self, label: str, what: str) -> None:
        self.label = label
        self.what = what  # "vLLM server", for messages
        self.workdir = Path(tempfile.mkdtemp(prefix=f"rollfleet-{label}-"))
        self.log_path = self.workdir / "server.log"
        self._socket_dir: Optional[Path] = None  # when the work dir's path is too long for a socket
        self._proc: Optional[subprocess.Popen] = None
        self._watcher: Optional[asyncio.Task] = None
        #: The watcher killed the group when its leader died: its id is free for reuse since, so
        #: nothing signals it again.
        self._group_killed = False

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> Optional[int]:
        """The exit code once the process has exited, else None (also before it is spawned)."""
        return self._proc.poll() if self._proc is not None else None

    def exit_reason(self) -> str:
        return f"{self.what} process {self.pid} exited with code {self.returncode}"

    def socket_path(self) -> str:
        """Where the server's private Unix socket goes: in the work dir, whose mode (0700) lets no
        other user reach it; in a short private dir of ``/tmp`` when the work dir's path is too
        long for a socket address."""
        path = self.workdir / "server.sock"
        if len(str(path)) > MAX_SOCKET_PATH:
            if self._socket_dir is None:
                self._socket_dir = Path(tempfile.mkdtemp(prefix="rollfleet-", dir="/tmp"))
            path = self._socket_dir / "server.sock"
        return str(path)

    def spawn(self, command: list[str], env: dict[str, str]) -> None:
        env = dict(env)
        install_guard(env, self.workdir / "site")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=str(self.workdir),
            )  # fmt: skip
        _LIVE_GROUPS.add(self._proc.pid)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            tail = deque(f, maxlen=lines)
        return b"".join(tail).decode("utf-8", "replace")

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call ``on_exit(reason)`` as soon as the process exits (checked every WATCH_INTERVAL_S),
        after killing what is left of its group: vLLM's EngineCore and workers do not notice their
        API server dying and would go on computing (on a GPU: holding its memory, so that the
        replica's restart could not load) for requests nobody can collect any more."""

        async def watcher() -> None:
            while not self._exited():  # noqa: ASYNC110 - a child's exit sets no event to wait on
                await asyncio.sleep(WATCH_INTERVAL_S)
            # Killed before the leader is reaped where possible: its zombie keeps the group's id
            # from being anyone else's while the signal goes out.
            self.kill_now()
            self._group_killed = True
            if self._proc is not None:
                _LIVE_GROUPS.discard(self._proc.pid)
            on_exit(self.exit_reason())

        self._watcher = asyncio.get_running_loop().create_task(watcher(), name=f"{self.label}-watch")

    def _exited(self) -> bool:
        """Whether the process has exited, leaving it unreaped (a zombie) where it still is."""
        if self._proc is None or self._proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except (AttributeError, OSError):  # reaped meanwhile by someone else (ChildProcessError), or no waitid (macOS)
            return self.returncode is not None

    async def exited_within(self, wait_s: float = EXIT_GRACE_S) -> bool:
        deadline = time.monotonic() + wait_s
        while self.returncode is None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def wait_ready(
        self,
        probe: Callable[[float], Awaitable[Optional[str]]],
        timeout_s: float,
        error: type[ServerStartupError] = ServerStartupError,
    ) -> None:
        """Until ``probe`` (given the time left) answers None; raise ``error`` with the log tail
        when the process exits first or ``timeout_s`` runs out."""
        try:
            await wait_ready(probe, timeout_s, self.label, self.what, self)
        except ServerStartupError as e:
            raise error(self.label, f"{e.reason}; last lines of {self.log_path}:\n{self.log_tail()}") from None

    def kill_now(self) -> None:
        """SIGKILL the group at once (a start-up that was cancelled or broke, a leader that died)."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)

    async def kill(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``, reap the leader."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        proc = self._proc
        if proc is None:
            return
        if self._group_killed:  # its id may be another group's by now: only reap
            await self.reap()
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        descendants = _descendants(proc.pid)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _running(descendants):
                break
            await asyncio.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        for pid in descendants:  # children that left the group (setsid) are killed one by one
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        await self.reap()
        # SIGKILL is delivered asynchronously: return once nothing of the server runs any more.
        deadline = time.monotonic() + KILL_WAIT_S
        while _running(descendants) and time.monotonic() < deadline:  # noqa: ASYNC110 - polling /proc
            await asyncio.sleep(0.05)
        _LIVE_GROUPS.discard(pgid)

    async def reap(self) -> None:
        if self._proc is not None:
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def remove_workdir(self, keep: bool = False) -> None:
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def wait_ready(
    probe: Callable[[float], Awaitable[Optional[str]]],
    timeout_s: float,
    label: str,
    what: str,
    process: Optional[ServerProcess] = None,
) -> None:
    """Poll ``probe`` (given the time left; it answers None when ready, else what it saw) until the
    server is ready; raise ServerStartupError when ``process`` exits or ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        code = process.returncode if process is not None else None
        if code is not None:
            await process.reap()  # type: ignore[union-attr]
            raise ServerStartupError(label, f"{what} exited with code {code} during start-up")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartupError(label, f"{what} not ready after {timeout_s:.1f}s ({last})")
        seen = await probe(remaining)
        if seen is None:
            return
        last = seen
        await asyncio.sleep(min(READY_POLL_S, max(0.05, deadline - time.monotonic())))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running: neither gone nor a zombie waiting to be reaped (a killed
    server's orphans are reaped by init, which may take a moment, or never in a container whose
    init does not reap: a zombie holds no memory, so it does not count)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - vLLM depends on psutil
        return [pid for pid in pids if _exists(pid)]
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


__all__ = ["ServerProcess", "ServerStartupError", "free_port", "wait_ready", "LOG_TAIL_LINES"]
