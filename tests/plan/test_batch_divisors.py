"""plan/batch.divisors_desc finds divisors in pairs up to sqrt(n): the same list as counting down
from n, and no typed count makes it long (issue 31: a batch of 1e20 hung the planner)."""

from __future__ import annotations

from ftlaunch.plan.batch import divisors_desc, split_batch


def test_divisors_are_those_of_counting_down():
    for n in range(1, 600):
        assert divisors_desc(n) == [d for d in range(n, 0, -1) if n % d == 0]


def test_a_huge_batch_is_split_at_once():
    n = 2**40 * 3
    ds = divisors_desc(n)
    assert ds[0] == n and ds[-1] == 1 and len(ds) == 41 * 2
    assert split_batch(2**40, 8) == (8, 2**37)
