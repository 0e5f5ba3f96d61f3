"""What the fake inference servers (``fake_sglang.py``, ``fake_vllm.py``) share: a deterministic token
model, one generation loop, and running a FastAPI app on a real loopback socket.

* Token ids follow ``next = (last * 31 + 7 + salt) % vocab_size`` starting from the last prompt id;
  ``salt`` changes on every weight update so tests can see new weights; the logprob of token ``t``
  is ``-((t * 7) % 50 + 1) / 10``.
* :func:`run_generation` produces tokens ``token_delay_s`` apart (so aborts and pauses land
  mid-generation) until the budget, a stop id (after ``min_new`` tokens) or an abort.
* ``FakeServer(...).start()`` runs the app with uvicorn on a free loopback port in a background
  thread; ``stop()`` shuts it down so the port refuses connections. Every request is recorded
  (path and JSON body) in ``requests``. ``python fake_x.py --port N`` runs one as a process, for
  tests of the launch path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from typing import Any, Optional

import uvicorn
from fastapi import FastAPI, Request

#: The unit tier's vocabulary and a prompt in it.
VOCAB = 1000
PROMPT = [11, 12, 13]


def next_token(last: int, salt: int, vocab_size: int) -> int:
    return (last * 31 + 7 + salt) % vocab_size


def token_logprob(token: int) -> float:
    return -(((token * 7) % 50) + 1) / 10.0


def expected_tokens(prompt_ids: list[int], n: int, *, salt: int = 0, vocab_size: int = 1000) -> list[int]:
    """The first ``n`` tokens a fake generates for ``prompt_ids`` under weights ``salt``."""
    out, last = [], prompt_ids[-1]
    for _ in range(n):
        last = next_token(last, salt, vocab_size)
        out.append(last)
    return out


def salt_for(path: str) -> int:
    """The weight salt a weight update from ``path`` installs (never 0)."""
    return sum(path.encode()) % 97 + 1


async def run_generation(fake: "FakeServer", state: dict[str, Any], last: int, max_new: int, min_new: int,
                         stop_ids: set[int]) -> tuple[str, Optional[int]]:  # fmt: skip
    """Fill ``state["tokens"]``/``["logprobs"]`` until done; (``stop|length|abort``, matched stop id)."""
    while True:
        if state["abort"]:
            return "abort", None
        if len(state["tokens"]) >= max_new:
            return "length", None
        await asyncio.sleep(fake.token_delay_s)
        if state["abort"]:
            continue
        last = next_token(last, fake.salt, fake.vocab_size)
        state["tokens"].append(last)
        state["logprobs"].append(token_logprob(last))
        if last in stop_ids and len(state["tokens"]) >= min_new:
            return "stop", last


async def wait_until(predicate, timeout: float = 5.0) -> None:
    """Poll ``predicate`` (from a test's event loop) until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


class FakeServer:
    """A FastAPI app (built by ``_build_app``) served on a real loopback socket."""

    def __init__(self, *, vocab_size: int, token_delay_s: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.token_delay_s = token_delay_s
        self.salt = 0
        self.paused = False
        self.requests: list[tuple[str, Any]] = []
        self.running: dict[str, dict[str, Any]] = {}  # id -> {"tokens", "logprobs", "abort", "prompt"}
        self.app = self._build_app()
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None
        self.port: Optional[int] = None

    def _build_app(self) -> FastAPI:
        raise NotImplementedError

    @property
    def url(self) -> str:
        assert self.port is not None, "server not started"
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app, log_level="warning", lifespan="off", loop="asyncio", http="h11",
            timeout_graceful_shutdown=1, access_log=False,
        )  # fmt: skip

    def start(self) -> "FakeServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(self._config())
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=type(self).__name__
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self.release_all()  # let held/running generations end so shutdown is not delayed by them
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None

    def release_all(self) -> None:
        self.paused = False
        for state in list(self.running.values()):
            state["abort"] = True

    def drain(self, timeout_s: float = 2.0) -> None:
        """Leftovers of a failed test: release held requests, abort running ones, let them finish."""
        self.release_all()
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.005)

    def __enter__(self) -> "FakeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    async def record(self, request: Request) -> Any:
        raw = await request.body()
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode(errors="replace")
        self.requests.append((request.url.path, body))
        return body

    @classmethod
    def main(cls, **settings: Any) -> None:
        """``python fake_x.py (--host H --port N | --uds PATH) [--vocab-size V]``: serve until killed."""
        parser = argparse.ArgumentParser()
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int)
        parser.add_argument("--uds")
        parser.add_argument("--vocab-size", type=int, default=1000)
        args, _ = parser.parse_known_args()
        fake = cls(vocab_size=args.vocab_size, **settings)
        config = fake._config()
        config.host, config.port, config.uds = args.host, args.port, args.uds
        uvicorn.Server(config).run()


__all__ = [
    "VOCAB",
    "PROMPT",
    "FakeServer",
    "expected_tokens",
    "next_token",
    "token_logprob",
    "salt_for",
    "run_generation",
    "wait_until",
]
