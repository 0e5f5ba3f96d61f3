"""Clients of the fleet: :class:`LLMServerClient` and :class:`FullyAsyncLLMServerClient`."""

from rollfleet.client.fully_async import FullyAsyncLLMServerClient
from rollfleet.client.llm_client import LLMServerClient, rollout_config_of
from rollfleet.client.retry import RetryPolicy

__all__ = ["LLMServerClient", "FullyAsyncLLMServerClient", "RetryPolicy", "rollout_config_of"]
