"""Fixtures for the agent-loop tests (helpers live in agent_loop_helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from rollfleet.agent_loop import load_tokenizer

    return load_tokenizer("tiny")
