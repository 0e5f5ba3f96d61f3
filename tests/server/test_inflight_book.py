"""A replica counts its in-flight requests per client, so each client's router can tell its own
load from everyone else's at the moment the replica counted, and knows which wait at its gate, so
that an abort reaches them too (see rollfleet.server.inflight)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollfleet.config import RolloutConfig, SimEngineConfig
from rollfleet.server.inflight import InflightBook
from rollfleet.server.replica import Replica
from rollfleet.types import LoadReport

pytestmark = pytest.mark.unit


def test_book_counts_in_and_out_whatever_ends_the_block():
    book = InflightBook()
    with book.entry("sess", "e1", 10, "a"), book.entry("sess", "e2", 5, "b"):
        with pytest.raises(RuntimeError):
            with book.entry("other", "e3", 7, "a"):
                assert book.by_client() == {"a": (2, 17), "b": (1, 5)}
                raise RuntimeError("engine failed")
        assert (book.requests, book.tokens) == (2, 15)
        assert sorted(book.engine_ids("sess")) == ["e1", "e2"] and book.engine_ids("other") == []
        assert book.by_client("a") == {"a": (1, 10)} and book.by_client("nobody") == {"nobody": (0, 0)}
    assert (book.requests, book.tokens, book.by_client()) == (0, 0, {})
    with book.entry("anon", "e4", 3, None):  # a caller without an id is counted in all only
        assert (book.requests, book.by_client()) == (1, {})


async def test_replica_reports_split_by_client_on_responses_and_polls():
    cfg = RolloutConfig(
        name="sim", response_length=2000, max_model_len=4000, sim=SimEngineConfig(vocab_size=500, step_base_ms=2.0)
    )
    r = Replica("r0", cfg, 0)
    await r.start(version=0)
    long = {"max_tokens": 1500, "ignore_eos": True}
    try:
        a_long = asyncio.ensure_future(r.generate_with_load("a1", [1, 2, 3], long, client_id="a"))
        b_long = [asyncio.ensure_future(r.generate_with_load(f"b{i}", [1] * 7, long, client_id="b")) for i in range(2)]
        await asyncio.sleep(0.05)
        polled = await r.load()
        assert (polled.inflight, polled.inflight_tokens) == (3, 17)
        assert polled.by_client == {"a": (1, 3), "b": (2, 14)}
        short = await r.generate_with_load("a2", [4, 5], {"max_tokens": 2}, client_id="a")
        assert short.load.by_client == {"a": (1, 3)}  # the requester's share only; this one is out
        assert polled.for_client("b").by_client == {"b": (2, 14)}
        assert polled.for_client("c").by_client == {"c": (0, 0)} and polled.for_client(None).by_client is None
        for task in (a_long, *b_long):
            task.cancel()
        await asyncio.gather(a_long, *b_long, return_exceptions=True)
        after = await r.load()
        assert (after.inflight, after.inflight_tokens, after.by_client) == (0, 0, {})  # cancelled: nothing leaks
    finally:
        await r.shutdown()


def test_a_report_without_a_split_stays_unsplit_for_every_client():
    report = LoadReport(replica_id="r0", inflight=3)
    assert report.for_client("a") is report


async def test_an_abort_reaches_the_requests_held_at_a_paused_replicas_gate():
    """The engine never saw them: before, abort() reported 1 and abort_all() 0, and after the
    resume each generated its whole budget."""
    cfg = RolloutConfig(
        name="sim", response_length=200, max_model_len=4000, sim=SimEngineConfig(vocab_size=500, step_base_ms=1.0)
    )
    r = Replica("r0", cfg, 0)
    await r.start(version=0)
    params = {"max_tokens": 50, "ignore_eos": True}

    async def streamed(request_id: str) -> Any:
        async for item in r.generate_stream(request_id, [1, 2, 3], params):
            last = item
        return last.output

    try:
        await r.pause()
        held = [
            asyncio.ensure_future(r.generate("one", [1, 2, 3], params)),
            asyncio.ensure_future(r.generate("two", [1, 2, 3], params)),
            asyncio.ensure_future(streamed("three")),
        ]
        while (await r.load()).inflight < 3:
            await asyncio.sleep(0.01)
        assert await r.abort("one") == 1
        assert await r.abort_all() == 2  # "two" and "three": the engine itself had nothing
        assert await r.abort_all() == 0  # aborted once is enough
        await r.resume()
        outs = await asyncio.wait_for(asyncio.gather(*held), 10)
        assert [(o.stop_reason, len(o.token_ids)) for o in outs] == [("aborted", 0)] * 3
        assert all(o.extra_fields["global_steps"] == 0 for o in outs)
        assert (await r.load()).inflight == 0
        after = await r.generate("four", [1, 2, 3], params)  # the next one is not aborted
        assert (after.stop_reason, len(after.token_ids)) == ("length", 50)
    finally:
        await r.shutdown()
