"""``rollfleet.utils.lists``: the C-speed conversions give what the per-element comprehensions give."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from rollfleet.utils import lists

pytestmark = pytest.mark.unit

VERSION_LISTS = [
    [],
    [3] * 50,
    [3] * 20 + [4] * 30,
    [None] * 5,
    [None, 2, 2, None],
    [2, None],
    [np.int64(5)] * 4,
    [5, np.int64(5), 5.0, True * 5, Fraction(10, 2)],  # all equal to 5, of five types
    [1, True, 1.0],
    [7, 7, 7.5 - 0.5, 8],
    [0, 0, None],
]


@pytest.mark.parametrize("values", VERSION_LISTS, ids=range(len(VERSION_LISTS)))
def test_versions_equals_the_comprehension_in_value_and_type(values):
    want = [-1 if v is None else int(v) for v in values]
    got = lists.versions(values, unknown=-1)
    assert got == want
    assert [type(v) for v in got] == [int] * len(want)
    assert got is not values


def test_versions_returns_a_new_list_the_caller_may_change():
    values = [2] * 4
    got = lists.versions(values, unknown=-1)
    got[0] = 9
    assert values == [2] * 4
