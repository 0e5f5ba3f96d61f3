"""Registers the ``vllm`` marker (tests that start a real vLLM server, ~40 s each start-up) and
serves the fake servers of the unit tier: started once per test module, reset by each test."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts a real vLLM server (slow; needs the vllm package)")


@pytest.fixture(scope="module")
def fake_servers():
    """``fake_servers("vllm" | "sglang")``: the module's fake server of that kind (starting one per
    test costs ~0.3 s), running on a real loopback socket until the module is done."""
    try:
        from tests.engines.fake_sglang import FakeSGLangServer
        from tests.engines.fake_vllm import FakeVLLMServer
    except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
        from fake_sglang import FakeSGLangServer
        from fake_vllm import FakeVLLMServer

    kinds = {
        "vllm": lambda: FakeVLLMServer(vocab_size=1000, max_model_len=256),
        "sglang": lambda: FakeSGLangServer(vocab_size=1000, context_length=256),
    }
    started: dict = {}
    yield lambda kind: started.get(kind) or started.setdefault(kind, kinds[kind]().start())
    for server in started.values():
        server.stop()
