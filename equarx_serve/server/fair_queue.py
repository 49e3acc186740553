"""The worker's queue: requests take turns, whatever the number of prompts each carries.

An OpenAI request may carry many prompts (`"prompt": [...]`), each a job of its own. In one
first-in first-out queue a request of 64 prompts took 64 of the queue's places (every other
client got 503 at once) and ran all of them before the next request's first. Here a request's
jobs form a group that takes one place (`len` counts groups), and `popleft` takes one job from
each waiting group in turn (round-robin, groups in arrival order), so a short request that
arrives behind a long one is admitted at the next free slot of the batch.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator

__all__ = ["FairQueue"]


class FairQueue[T]:
    """Jobs in groups, taken round-robin over the groups (see the module doc)."""

    def __init__(self) -> None:
        self._groups: collections.OrderedDict[Hashable, collections.deque[T]] = (
            collections.OrderedDict()
        )
        self._items = 0

    def __len__(self) -> int:
        """The number of groups waiting (the places taken in the queue)."""
        return len(self._groups)

    @property
    def items(self) -> int:
        """The number of jobs waiting."""
        return self._items

    def __iter__(self) -> Iterator[T]:
        for group in self._groups.values():
            yield from group

    def __contains__(self, item: object) -> bool:
        return any(item in group for group in self._groups.values())

    def has_group(self, group: Hashable) -> bool:
        return group in self._groups

    def append(self, group: Hashable, item: T) -> None:
        self._groups.setdefault(group, collections.deque()).append(item)
        self._items += 1

    def popleft(self) -> T:
        """The oldest job of the group whose turn it is; that group goes to the back of the
        line (or leaves it, once empty). IndexError when empty."""
        if not self._groups:
            raise IndexError("pop from an empty FairQueue")
        group, items = next(iter(self._groups.items()))
        item = items.popleft()
        self._items -= 1
        if items:
            self._groups.move_to_end(group)
        else:
            del self._groups[group]
        return item

    def remove(self, group: Hashable, item: T) -> bool:
        """Takes `item` out of `group`; False if it was not waiting there."""
        items = self._groups.get(group)
        if items is None or item not in items:
            return False
        items.remove(item)
        self._items -= 1
        if not items:
            del self._groups[group]
        return True

    def clear(self) -> list[T]:
        """Empties the queue; the jobs it held, in group order."""
        items = list(self)
        self._groups.clear()
        self._items = 0
        return items
