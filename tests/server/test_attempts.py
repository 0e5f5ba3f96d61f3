"""``stamp_versions``: an output's per-token versions and its first and last, however the engine
labelled its tokens (one version, several, none before the first commit)."""

from __future__ import annotations

from typing import Optional

import pytest

from rollfleet.server.attempts import Attempt, stamp_versions
from rollfleet.types import TokenOutput

pytestmark = pytest.mark.unit


def _reference(labels: list[Optional[int]], version: Optional[int]) -> tuple[list, Optional[int], Optional[int]]:
    """What stamping means, one token at a time: a None label is the attempt's version."""
    stamped = [version if v is None else v for v in labels]
    known = [v for v in stamped if v is not None]
    return stamped, (min(known) if known else version), (max(known) if known else version)


CASES = [
    ([], 3),
    ([4] * 10, 3),
    ([None] * 6, 3),
    ([None] * 6, None),
    ([None, None, 5, 5, 6], 4),
    ([None, None, 5, 5, 6], None),
    ([2, 2, 1], None),  # not sorted: min and max, not first and last
    ([None, 7], 9),  # the attempt's version is the largest
    ([0, 0, 0], 0),
]


@pytest.mark.parametrize("labels,version", CASES, ids=range(len(CASES)))
def test_stamp_versions_labels_every_token_and_the_first_and_last(labels, version):
    out = TokenOutput(token_ids=list(range(len(labels))), log_probs=[0.0] * len(labels), token_versions=list(labels))
    attempt = Attempt("e", [1], {}, epoch=0, version=version, started=0.0)
    stamp_versions(out, attempt, epoch_now=1, version_now=99)  # a weight change during the attempt
    stamped, first, last = _reference(labels, version)
    assert out.token_versions == stamped
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (first, last)
    assert out.extra_fields["global_steps"] == last


def test_the_stamped_list_is_the_outputs_own():
    labels = [1, 1, 1]
    out = TokenOutput(token_ids=[5, 6, 7], log_probs=[0.0] * 3, token_versions=labels)
    stamp_versions(out, Attempt("e", [1], {}, 0, 1, 0.0), epoch_now=0, version_now=1)
    out.token_versions[0] = 9
    assert labels == [1, 1, 1]


@pytest.mark.parametrize("keep_commits, labelled", [(0, ([1] * 4, 1, 1)), (1, (None, 1, 2))])
def test_an_attempt_aborted_after_a_keep_commit_is_not_labelled_with_its_first_version_alone(keep_commits, labelled):
    """An aborted attempt was taken to have stopped before any weight change: true of an abort
    commit (it aborts the attempt, then loads), not of a keep one, across which the request goes
    on. An engine that gave no per-token versions then (SGLang's overlap scheduler) got every
    token labelled with the old version, the newer tokens too."""
    out = TokenOutput(token_ids=[5, 6, 7, 8], log_probs=[0.0] * 4, token_versions=None, stop_reason="aborted")
    attempt = Attempt("e", [1], {}, epoch=0, version=1, started=0.0, keep_epoch=0)
    stamp_versions(out, attempt, epoch_now=1, version_now=2, keep_epoch_now=keep_commits)
    versions, first, last = labelled
    assert out.token_versions == versions
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (first, last)


async def test_a_request_that_outlived_a_pause_is_not_labelled_with_the_weights_before_the_load(monkeypatch):
    """An abort-mode commit's pause gave up waiting for a request still out (a slow socket, a
    starved server), then loaded; the request ran on the new weights, and when it came back
    aborted, unlabelled by a server without version spans, every token was stamped with the
    version before. The drain now says which calls it gave up on, the engine marks their output,
    and the replica labels their tokens unknown (first and last: the versions either side)."""
    import asyncio

    from rollfleet.engines.base import VERSIONS_UNKNOWN
    from rollfleet.engines.http import inflight
    from rollfleet.engines.http.inflight import Inflight, InflightTable

    monkeypatch.setattr(inflight, "DRAIN_TIMEOUT_S", 0.05)
    table = InflightTable()
    back = table.add(Inflight("a", "a-1", 10, sent=True))
    stuck = table.add(Inflight("b", "b-1", 10, sent=True))
    sent_aborts: list[list[str]] = []

    async def send_abort(out: list[Inflight], first: bool) -> None:
        sent_aborts.append([c.wire_id for c in out])
        table.remove(back)  # one comes back; the other never answers

    left = await asyncio.wait_for(table.drain([back, stuck], send_abort, lambda: True), 5)
    assert left == [stuck] and sent_aborts[0] == ["a-1", "b-1"]

    attempt = Attempt("e", [1], {}, epoch=0, version=1, started=0.0, keep_epoch=0)
    unknown = TokenOutput(token_ids=[5, 6, 7], log_probs=[0.0] * 3, token_versions=None, stop_reason="aborted")
    unknown.extra_fields[VERSIONS_UNKNOWN] = True
    stamp_versions(unknown, attempt, epoch_now=1, version_now=2)
    assert unknown.token_versions is None
    assert (unknown.extra_fields["min_global_steps"], unknown.extra_fields["max_global_steps"]) == (1, 2)
    before = TokenOutput(token_ids=[5, 6, 7], log_probs=[0.0] * 3, token_versions=None, stop_reason="aborted")
    stamp_versions(before, attempt, epoch_now=1, version_now=2)  # back before the load: the old weights'
    assert before.token_versions == [1, 1, 1]
    # the engine's side: the output of a call the pause gave up on, and only of one, says so
    from collections import Counter
    from types import SimpleNamespace

    from rollfleet.engines.http.engine import HTTPEngine

    engine = SimpleNamespace(_counts=Counter())
    stuck.outlived_pause = True  # what HTTPEngine.pause does with the calls the drain returns
    for call, flagged in ((stuck, True), (back, False)):
        out = TokenOutput(token_ids=[5], log_probs=[0.0], token_versions=None, stop_reason="aborted")
        HTTPEngine._counted(engine, out, call)  # type: ignore[arg-type]
        assert bool(out.extra_fields.get(VERSIONS_UNKNOWN)) is flagged
