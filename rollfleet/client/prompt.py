"""The one check a client makes of a prompt before routing it.

A replica validates a prompt in full (each id an integer inside its vocabulary) and names the bad
element. Routing reads the prompt first, though: its length, and a digest of its ids that places
siblings together. A prompt that is not a sequence of integers (None, a number, a string, an id
that is itself a list) broke there with a bare ``TypeError``; checked here, it gets the
replica's kind of error, ``InvalidRequest`` naming the field, before anything is counted.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from rollfleet.errors import InvalidRequest


def checked_prompt(prompt_ids: Any) -> list[int]:
    """``prompt_ids`` as a list of integer ids (the caller's list itself when it is one), or
    ``InvalidRequest`` naming ``prompt_ids`` or the element that is not an integer."""
    if type(prompt_ids) is not list:
        if prompt_ids is None or isinstance(prompt_ids, (str, bytes, Mapping)) or not isinstance(prompt_ids, Iterable):
            raise InvalidRequest("prompt_ids", "a list of token ids", prompt_ids)
        prompt_ids = list(prompt_ids)
    if set(map(type, prompt_ids)) <= {int}:  # the common case, in C
        return prompt_ids
    for i, tok in enumerate(prompt_ids):
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise InvalidRequest(f"prompt_ids[{i}]", "an integer token id", tok)
    return prompt_ids


__all__ = ["checked_prompt"]
