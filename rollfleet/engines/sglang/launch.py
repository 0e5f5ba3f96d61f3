"""How an SGLang server is launched: ``python -m sglang.launch_server`` with its flags and devices.

Placement decides where the server listens and what it sees (``Engine.assign``): ``--host`` is
:attr:`bind_host` and ``CUDA_VISIBLE_DEVICES`` exactly :attr:`devices` when placement gave some.
``--enable-metrics`` mounts ``/metrics``, which ``load()`` prefers (it has KV usage). Sleep needs
``--enable-memory-saver``: pass it in ``extra_args``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional


class SGLangLaunch:
    """The launch half of :class:`~rollfleet.engines.sglang.SGLangEngine` (its settings are the engine's)."""

    model: str
    port: Optional[int]
    bind_host: str
    devices: Optional[list[str]]
    tp_size: int
    mem_fraction_static: float
    context_length: Optional[int]
    seed: Optional[int]
    extra_args: list[str]

    def _command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model,
            "--host", self.bind_host,
            "--port", str(self.port),
            "--tp-size", str(self.tp_size),
            "--mem-fraction-static", str(self.mem_fraction_static),
            "--enable-metrics",
        ]  # fmt: skip
        if self.context_length is not None:
            cmd += ["--context-length", str(self.context_length)]
        if self.seed is not None:
            cmd += ["--random-seed", str(self.seed)]
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        """The server's environment: exactly the devices placement gave this replica."""
        env = dict(os.environ)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        return env


__all__ = ["SGLangLaunch"]
