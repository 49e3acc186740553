"""`FairQueue`: a group takes one place, groups take turns, nothing is lost or duplicated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from equarx_serve.server.fair_queue import FairQueue


def test_a_long_request_and_a_short_one_take_turns():
    queue: FairQueue[str] = FairQueue()
    for i in range(64):
        queue.append("long", f"long-{i}")
    queue.append("short", "short-0")
    assert (len(queue), queue.items) == (2, 65)
    assert [queue.popleft() for _ in range(3)] == ["long-0", "short-0", "long-1"]
    assert (len(queue), queue.items) == (1, 62)


def test_removing_the_last_job_of_a_group_frees_its_place():
    queue: FairQueue[str] = FairQueue()
    queue.append("a", "a-0")
    assert not queue.remove("b", "a-0")
    assert queue.remove("a", "a-0")
    assert (len(queue), queue.items, queue.has_group("a")) == (0, 0, False)
    with pytest.raises(IndexError):
        queue.popleft()


@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=60))
def test_every_job_comes_out_once_in_its_groups_order(operations):
    """Appends (True) and pops (False) in any order: each group's jobs leave in the order they
    came, each once; a pop takes from the group waiting longest since its last turn."""
    queue: FairQueue[tuple[int, int]] = FairQueue()
    appended: dict[int, int] = {}
    popped: list[tuple[int, int]] = []
    for group, is_append in operations:
        if is_append:
            queue.append(group, (group, appended.get(group, 0)))
            appended[group] = appended.get(group, 0) + 1
        elif queue.items:
            first_in_line = next(iter(queue))[0]
            popped.append(queue.popleft())
            assert popped[-1][0] == first_in_line
    popped += [queue.popleft() for _ in range(queue.items)]
    assert sorted(popped) == sorted((g, i) for g, n in appended.items() for i in range(n))
    for group in appended:
        assert [i for g, i in popped if g == group] == list(range(appended[group]))
    assert len(queue) == 0
