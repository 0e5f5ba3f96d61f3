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
