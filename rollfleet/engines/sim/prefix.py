"""The sim engine's prefix cache, kept as vLLM keeps it: cached blocks are the KV cache's free ones.

A block is named by the chained hash of its tokens (:meth:`BatchModel._hashes_of`). Two kinds of
block are cached:

* **held**: a running request's blocks (with ``cache_on_prefill``, from its prefill on). Every later
  request with that prefix shares them, and nothing evicts them: in vLLM a block with a reference
  is not in the free queue.
* **free**: blocks no running request holds, in an LRU. A request that ends frees its blocks tail
  first, as vLLM's ``free_blocks`` does, so that a prompt its siblings and next turns share is the
  last of its blocks to go. A free block is evicted when the engine takes KV for another: the
  free blocks cached are never more than the KV cache has free (and never more than the optional
  ``prefix_cache_blocks``).

Where the sim differs from vLLM: a request is charged KV blocks for its whole context even where
it shares a held prefix (vLLM holds a shared block once), so the cache is a little smaller here;
and a context cached whole is served whole, where vLLM caps a hit at all but the last token and so
computes the last block again (a block of prefill per sibling of a group, not charged here).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class PrefixCache:
    """Held and free cached blocks of one engine; ``len()`` counts the free ones."""

    def __init__(self, bound: Optional[int]) -> None:
        self.bound = bound  # most free blocks kept (None: as many as the KV cache has free; 0: no cache)
        self._free: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._held: dict[int, int] = {}  # block -> how many running requests hold it
        #: Held blocks whose prefill no step has done yet (:meth:`hold`, :meth:`prefilled`): a
        #: request admitted beside the one computing them shares them, as in vLLM, but if every
        #: holder leaves before that step ends (a pause throws the step away), nothing computed them.
        self._pending: set[int] = set()
        self._epoch = 0  # a clear starts a new one: what was held before it is not released into it

    @property
    def epoch(self) -> int:
        """How many times the cache was cleared: blocks computed before a clear are not cached after it."""
        return self._epoch

    @property
    def enabled(self) -> bool:
        return self.bound != 0

    def __len__(self) -> int:
        return len(self._free)

    def hit_blocks(self, hashes: list[int]) -> int:
        """How many of ``hashes``, from the first, are cached (the free ones become most recent)."""
        if not self.enabled:
            return 0
        free = self._free
        hits = 0
        for h in hashes:
            if h not in self._held and h not in free:
                break
            hits += 1
        for h in reversed(hashes[:hits]):  # tail first, as insert: the head goes last
            if h in free:
                free.move_to_end(h)
        return hits

    def hold(self, hashes: list[int], hits: int) -> tuple[int, int]:
        """A running request holds ``hashes``, of which the first ``hits`` were cached (the rest
        its prefill computes); returns the handle :meth:`release` takes back."""
        if not self.enabled:
            return (0, 0)
        held = self._held
        for h in hashes:
            held[h] = held.get(h, 0) + 1
            self._free.pop(h, None)
        self._pending.update(hashes[hits:])
        return (len(hashes), self._epoch)

    def prefilled(self) -> None:
        """A step ended: it did the prefill of every request admitted for it."""
        self._pending.clear()

    def release(self, hashes: list[int], handle: tuple[int, int], kv_free: int, computed: Optional[int] = None) -> None:
        """The request that :meth:`hold` returned ``handle`` to stopped running: the blocks no other
        request holds become free, cached if they hold KV (``computed``: how many of them, from the
        first, do; None: all), dropped if not."""
        count, epoch = handle
        if not count or epoch != self._epoch:
            return
        held, pending = self._held, self._pending
        limit = count if computed is None else computed
        freed = []
        for i, h in enumerate(hashes[:count]):
            left = held[h] - 1
            if left:
                held[h] = left
            else:
                del held[h]
                if h in pending:
                    pending.discard(h)  # its holders all left before a step computed it
                elif i < limit:
                    freed.append(h)
        self.insert(freed, kv_free)

    def insert(self, hashes: list[int], kv_free: int) -> None:
        """Cache ``hashes`` (a request's blocks, in context order) as free blocks, tail first."""
        if not self.enabled:
            return
        free = self._free
        for h in reversed(hashes):
            if h in self._held:
                continue  # held by a running request: cached already, and not evictable
            free[h] = None
            free.move_to_end(h)
        self.evict(kv_free)

    def evict(self, kv_free: int) -> None:
        """Drop the least recently used free blocks the KV cache no longer has free (called
        whenever the engine takes blocks: a free block holds its tokens only until reused)."""
        cap = kv_free if self.bound is None else min(kv_free, self.bound)
        free = self._free
        while len(free) > cap:
            free.popitem(last=False)

    def clear(self) -> None:
        """Forget every cached block, held ones too (new weights make them all stale)."""
        self._free.clear()
        self._held.clear()
        self._pending.clear()
        self._epoch += 1


__all__ = ["PrefixCache"]
