"""The shared core of the engines that drive an inference server over HTTP (``vllm``, ``sglang``).

One module per job, none aware of which server it talks to:

* :mod:`.process`: the supervised server process (its own session, work dir and log, the exit
  watcher, readiness, the kill of the whole group, atexit cleanup), with :mod:`.guard`, the parent
  guard that kills a server whose replica process died;
* :mod:`.transport`: the client pair (aiohttp for generation, httpx for control routes, idle
  keep-alive expiry under the server's) and the one transport-error rule;
* :mod:`.link`: the engine's link to its server, launched or attached (``base_url``), and whether
  it is alive;
* :mod:`.inflight`: the in-flight table, the pause/sleep gate, the abort loop that re-aborts
  requests still on the wire;
* :mod:`.wire`: the one finish-reason rule and the error-body reader; :mod:`.metrics`: the one
  Prometheus parser; :mod:`.vocab`: the vocabulary size from ``config.json``;
* :mod:`.engine`: :class:`HTTPEngine`, the base class that puts them together.

To add an engine for one more HTTP server: make a package ``rollfleet/engines/<name>/`` with a
pure ``wire.py`` (request body, response parsing, error fields, unit-tested alone), a
``launch.py`` mixin (``_command()``, ``_env()``: flags, environment, ``self.bind_host``,
``CUDA_VISIBLE_DEVICES`` from ``self.devices``) and an engine class that subclasses the mixin and
:class:`HTTPEngine`, implements its hooks (listed in :mod:`.engine`) and the ops whose routes are
its own (weights, sleep, profile); then register it in :mod:`rollfleet.engines`. Test it against a
fake server on a real socket (``tests/engines/fake_*.py``) through ``base_url``.
"""

from rollfleet.engines.http.engine import BUSY_GRACE_S, HTTPEngine
from rollfleet.engines.http.metrics import metric_samples, parse_metrics
from rollfleet.engines.http.process import ServerStartupError
from rollfleet.engines.http.vocab import read_vocab_size
from rollfleet.engines.http.wire import error_message, stop_reason

__all__ = [
    "HTTPEngine",
    "BUSY_GRACE_S",
    "ServerStartupError",
    "parse_metrics",
    "metric_samples",
    "read_vocab_size",
    "stop_reason",
    "error_message",
]
