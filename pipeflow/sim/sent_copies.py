"""What a device sent and holds until a message from the peer proves it arrived (the runtime's rule,
:mod:`pipeflow.runtime.messages`)."""

from __future__ import annotations

import heapq
import itertools


class SentCopies:
    """What a device sent, held until proven arrived by a message from its consumer's device made after the
    consumer ran: a forward's 16-bit copy, or a gradient sent back (``("sent", ...)``)."""

    def __init__(self) -> None:
        self._held: dict = {}  # name -> [its term, proven already]
        # consumer's device -> heap of (consumer's position, order sent, name, its entry)
        self._unproven: dict[int, list] = {}
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, name: tuple, term: int, consumer: tuple | None) -> None:
        entry = self._held[name] = [term, False]
        if consumer is not None:  # (a send no one consumes is never proven)
            heapq.heappush(self._unproven.setdefault(consumer[0], []), (consumer[1], next(self._order), name, entry))

    def proven_by(self, maker: tuple) -> list[int]:
        """The terms of the sends a message made at ``maker`` (device, index) proves arrived, in send order;
        a gradient sent back is let go, a forward's copy stays named until its backward."""
        due, heap = [], self._unproven.get(maker[0], ())
        while heap and heap[0][0] < maker[1]:
            _, n, name, entry = heapq.heappop(heap)
            if self._held.get(name) is entry and not entry[1]:
                due.append((n, name, entry))
        if not due:
            return due
        terms = []
        for _, name, entry in (sorted(due) if len(due) > 1 else due):
            entry[1] = True
            terms.append(entry[0])
            if name[0] == "sent":  # a gradient sent back: nothing more to hold
                del self._held[name]
        return terms

    def release(self, name: tuple) -> int | None:
        """A forward's copy let go at its backward: its term where already proven arrived, else None."""
        entry = self._held.pop(name, None)
        return entry[0] if entry is not None and entry[1] else None
