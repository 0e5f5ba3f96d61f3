"""What an aborted response had left to say, for when its client resumes it.

A client resumes an aborted response by sending the prompt plus the tokens so far. A real model
continues its own text; the sim engine, which draws a response's length from the prompt, would
see a new prompt and draw a whole new length: a response aborted after k tokens would run k plus
a fresh draw, not its own length, and move every plan whose weight syncs abort. So an engine
remembers the rest of each length it aborts, keyed as the resumed prompt will be keyed (the CRC of
its token ids, checked against its length). Kept per engine, where a sticky resume comes back; a
resume on another replica draws afresh.
"""

from __future__ import annotations

import zlib
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

#: Aborted responses an engine remembers the rest of the length of (the oldest forgotten first).
MAX_CONTINUATIONS = 1 << 16


def prompt_key_of(ids: Sequence[int]) -> int:
    """The key a prompt samples under: the CRC of its token ids."""
    return zlib.crc32(array("q", ids).tobytes())


class Continuations:
    """Bounded: ``prompt key -> (prompt length, tokens left)`` of the responses an engine aborted."""

    def __init__(self, limit: int = MAX_CONTINUATIONS) -> None:
        self.limit = limit
        self._left: OrderedDict[int, tuple[int, int]] = OrderedDict()

    def remember(self, context: list[int], left: int) -> None:
        """A response aborted with ``context`` (its prompt and tokens) had ``left`` tokens to go."""
        self._left[prompt_key_of(context)] = (len(context), left)
        if len(self._left) > self.limit:
            self._left.popitem(last=False)

    def take(self, key: int, prompt_len: int) -> Optional[int]:
        """The tokens left of the response this prompt resumes, if it was remembered (once)."""
        found = self._left.pop(key, None)
        return found[1] if found is not None and found[0] == prompt_len else None


__all__ = ["Continuations", "MAX_CONTINUATIONS", "prompt_key_of"]
