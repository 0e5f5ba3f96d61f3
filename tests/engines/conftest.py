"""Registers the ``vllm`` marker (tests that start a real vLLM server, ~40 s each start-up)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts a real vLLM server (slow; needs the vllm package)")
