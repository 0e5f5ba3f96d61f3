"""rollfleet.utils.ids: ids as wide as uuid4's hex, never repeated in a process, distinct across
processes (a forked child draws its own prefix)."""

from __future__ import annotations

import os
import re

import pytest

from rollfleet.utils.ids import unique_hex

pytestmark = pytest.mark.unit


def test_ids_are_32_hex_digits_and_never_repeat():
    ids = [unique_hex() for _ in range(20_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_draws_its_own_prefix():
    before = unique_hex()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write one id and leave at once
        os.write(write, unique_hex().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    after = unique_hex()
    assert len(child) == 32 and child[:20] != before[:20]
    assert after[:20] == before[:20] and after != before  # the parent goes on with its own
