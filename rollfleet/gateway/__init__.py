"""An OpenAI-compatible HTTP front door to the fleet, routed through the same client and policies.

``rollfleet serve --config fleet.yaml`` starts Ray, the fleet and the gateway. In code::

    gateway = Gateway(client, TextCodec.load("tiny"), config=cfg.gateway, rollout=cfg.rollout, admin=manager)
    server = await GatewayServer(gateway.app, port=0).start()     # server.url

Routes: ``GET /v1/models``, ``POST /v1/completions`` (text or token-id prompts),
``POST /v1/chat/completions`` (the model's chat template), both with ``stream``;
``POST /v1/completions/tokens`` (token ids in; token ids, logprobs and weight versions out);
``DELETE /v1/sessions/{id}``; ``GET /health``; ``GET /metrics``; ``/admin/*`` with a token.
Sessions stick by ``X-Session-ID`` (or ``session_id`` / ``user``); the replica that served a
request is in the ``X-Rollfleet-Replica`` response header.

Modules, one job each: ``protocol`` (request bodies), ``codec`` (tokenizer), ``sampling``
(request -> sampling params), ``service`` (the data path over the client), ``responses`` (bodies
and SSE chunks), ``errors`` (OpenAI error shape), ``metrics`` / ``poller`` (Prometheus),
``routes_openai`` / ``routes_admin`` (handlers), ``app`` (wiring), ``server`` (uvicorn in-loop),
``launch`` (fleet + gateway for the CLI), ``prometheus`` (scrape-config helpers).

To add a route: write the handler on :class:`~rollfleet.gateway.routes_openai.OpenAIRoutes`
(parse with ``parse_body``, raise ``GatewayError`` or let typed fleet errors propagate through
``_generate``), list it in ``routes()`` wrapped by ``gateway.instrument`` so it is counted and its
errors take the OpenAI shape, and add a test in ``tests/gateway``.
"""

from rollfleet.gateway.app import Gateway
from rollfleet.gateway.codec import TextCodec
from rollfleet.gateway.errors import GatewayError
from rollfleet.gateway.launch import GatewayStack, fit_sim_to_tokenizer, serve
from rollfleet.gateway.server import GatewayServer

__all__ = ["Gateway", "GatewayServer", "GatewayStack", "GatewayError", "TextCodec", "fit_sim_to_tokenizer", "serve"]
