"""The processes a plan spreads its runs over, and how they end with it.

A plan's runs are CPU-bound Python, minutes each at a large cluster's size, so a plan of several
runs takes a pool of spawned processes. They must not outlive the plan that started them: a
worker left running holds gigabytes and a core for minutes, computing a run nobody will read.

* a failed run or Ctrl-C (an exception in the parent) terminates the workers at once
  (``ProcessPoolExecutor.shutdown`` cancels only what has not started);
* SIGTERM (``kill``, ``timeout``, a CI runner or a job scheduler stopping the command) ends the
  parent through the same path: Python's default action would kill it outright, leaving its
  workers computing, their parent gone;
* a parent killed outright (SIGKILL, the OOM killer) cannot clean up: each worker watches its
  parent and exits when it is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

#: How often a worker checks that the process that started it is still there.
PARENT_CHECK_S = 0.5


@contextmanager
def plan_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``workers`` spawned processes (fresh interpreters: nothing inherited from a
    caller holding Ray, threads or a loop) that end with the plan, however it ends."""
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_parent,
        initargs=(os.getpid(),),
    )
    restore = _terminate_raises()
    try:
        yield pool
    except BaseException:  # a failed run, Ctrl-C or SIGTERM: the runs going are stopped
        stop_workers(pool)
        raise
    finally:  # and the runs not started are dropped
        try:
            pool.shutdown(wait=True, cancel_futures=True)
        finally:
            restore()


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate the pool's worker processes: ``shutdown`` only cancels what has not started, and
    would wait minutes for the runs in progress of a plan that has already failed. (The executor
    has no public way to do this before Python 3.14's ``terminate_workers``.)"""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


def _terminate_raises() -> Any:
    """While the pool is open, SIGTERM raises ``SystemExit`` (exit status 143, as the signal's)
    in the main thread, so the pool's clean-up runs. Only where SIGTERM has its default action (a
    caller's own handler is left alone) and in the main thread (the only one that may set it).
    Returns what puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def terminated(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker's initializer: a daemon thread that ends the worker once its parent is gone (it
    is then adopted: its parent's id changes)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="rollfleet-plan-parent-watch", daemon=True).start()


__all__ = ["plan_pool", "stop_workers", "PARENT_CHECK_S"]
