"""One generation attempt on a replica, and the weight versions its output is labelled with.

Why the replica and not the engine stamps versions: only the replica sees both the data plane and
the control plane. It counts weight changes (an epoch) and compares the epoch at the start and the
end of every attempt, so an output is never labelled with a version it was not produced under,
even when an engine does not pause cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rollfleet.engines.base import VERSIONS_UNKNOWN
from rollfleet.types import SamplingParams, TokenOutput


@dataclass(slots=True)
class Attempt:
    """An admitted attempt: its engine id, validated input, and the weights it started under."""

    engine_id: str
    prompt: list[int]
    params: SamplingParams
    epoch: int
    version: Optional[int]
    started: float
    aborted: bool = False  # aborted while held at the gate: the engine never sees it
    keep_epoch: int = 0  # the replica's keep-mode commits so far (in-flight requests go on across them)


def aborted_before_start() -> TokenOutput:
    """The output of an attempt aborted before the engine saw it: no tokens, to be resumed."""
    return TokenOutput(token_ids=[], log_probs=[], token_versions=[], stop_reason="aborted")


def stamp_versions(
    output: TokenOutput, attempt: Attempt, *, epoch_now: int, version_now: Optional[int], keep_epoch_now: int = 0
) -> None:
    """Label ``output``'s tokens, and its first and last version, with the weights that sampled them."""
    version = attempt.version
    if output.token_versions is not None and len(output.token_versions) == len(output.token_ids):
        # The engine knows which weights sampled each token (it was told at every commit);
        # tokens from before its first commit carry None: the weights it booted with.
        labels = output.token_versions
        if labels and labels.count(labels[0]) == len(labels):
            # One version throughout (the usual case: weights change between attempts): one pass
            # in C, where the general case below takes several, a measurable share of a plan.
            only = version if labels[0] is None else labels[0]
            output.token_versions = [only] * len(labels)
            first = last = only
        else:
            distinct = set(labels)  # a handful of versions: min and max over it, not over every token
            stamped = [version if v is None else v for v in labels] if None in distinct else list(labels)
            output.token_versions = stamped
            known = {v for v in distinct if v is not None}
            if None in distinct and version is not None:
                known.add(version)
            first = min(known) if known else version
            last = max(known) if known else version
    elif attempt.epoch == epoch_now or (
        output.stop_reason == "aborted"
        and attempt.keep_epoch == keep_epoch_now
        and not output.extra_fields.get(VERSIONS_UNKNOWN)
    ):
        # No weight change during the attempt (an aborted attempt stopped before an abort-mode
        # change; a keep-mode one goes on across it, so an attempt aborted after one is not so;
        # nor is one the engine says outlived the pause before a load).
        first = last = version
        output.token_versions = [version] * len(output.token_ids) if version is not None else None
    else:
        first, last = version, version_now
        output.token_versions = None  # which tokens came from which weights is unknown
    output.extra_fields["global_steps"] = last
    output.extra_fields["min_global_steps"] = first
    output.extra_fields["max_global_steps"] = last


__all__ = ["Attempt", "aborted_before_start", "stamp_versions"]
