"""The checks a client makes of a request before routing it: its prompt and its parameters' type.

A replica validates a prompt in full (each id an integer inside its vocabulary) and names the bad
element. Routing reads the prompt first, though: its length, and a digest of its ids that places
siblings together. A prompt that is not a sequence (None, a number, a string) broke there with a
bare ``TypeError``; checked here, it gets the replica's kind of error, ``InvalidRequest`` naming
the field, before anything is counted. A list is taken as it is (this runs per request): an id in
it that is itself a list is named by the digest (``prefix_key``) or the replica.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from rollfleet.errors import InvalidRequest


def checked_prompt(prompt_ids: Any) -> list[int]:
    """``prompt_ids`` as a list (the caller's list itself when it is one: its ids are checked by
    the replica, and by routing's digest only where it fails: ``prefix_key``), or
    ``InvalidRequest`` naming ``prompt_ids`` or the element that is not an integer."""
    if type(prompt_ids) is list:  # the common case costs one type check: this runs per request
        return prompt_ids
    if prompt_ids is None or isinstance(prompt_ids, (str, bytes, Mapping)) or not isinstance(prompt_ids, Iterable):
        raise InvalidRequest("prompt_ids", "a list of token ids", prompt_ids)
    ids = list(prompt_ids)
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise InvalidRequest(f"prompt_ids[{i}]", "an integer token id", tok)
    return ids


def checked_params(sampling_params: Any) -> dict[str, Any]:
    """``sampling_params`` itself (None: a new empty dict), or ``InvalidRequest`` naming it when it
    is no dict: a string or a list of pairs failed with a bare ``AttributeError`` or
    ``ValueError``, or was taken as its pairs where the replica refuses it. Not a copy: a client
    that fills in a budget copies it (the caller's dict is never changed)."""
    if sampling_params is None:
        return {}
    if not isinstance(sampling_params, dict):
        raise InvalidRequest("sampling_params", "a dict", sampling_params)
    return sampling_params


__all__ = ["checked_prompt", "checked_params"]
