"""Per-producer sequence accounting with bounded memory."""

from __future__ import annotations

import collections

# One connection delivers in order (one intake thread reads the socket); a producer that
# reconnects may resend around a cut, and the trained side sees enqueue threads finish out of
# order by a few places: remembering the last WINDOW numbers tells duplicates from late ones.
WINDOW = 256


class SequenceTracker:
    """Counts unique, duplicate and missing sequence numbers of one producer.

    ``recent`` holds the last ``WINDOW`` numbers seen (arrival order in ``_order``); a number
    below ``floor`` (one past the largest number evicted from ``recent``) is too old to be told
    apart and is treated as a duplicate.

    Invariants (after every ``record``):
      - ``len(recent) == len(_order) <= WINDOW``;
      - ``unique + duplicates`` == calls to ``record``;
      - ``missing == (highest - lowest + 1) - unique``: numbers in the seen span never seen.
    Not thread-safe: the owner (``Ledger``) serialises calls.
    """

    __slots__ = ("lowest", "highest", "floor", "recent", "_order", "unique", "duplicates")

    def __init__(self) -> None:
        self.lowest: int | None = None
        self.highest = -1
        self.floor = -1
        self.recent: set[int] = set()
        self._order: collections.deque[int] = collections.deque()
        self.unique = 0
        self.duplicates = 0

    def record(self, seq: int) -> bool:
        """Record ``seq``; return False if it is a duplicate (or too late to tell)."""
        if seq in self.recent or seq < self.floor:
            self.duplicates += 1
            return False
        self.recent.add(seq)
        self._order.append(seq)
        if len(self._order) > WINDOW:
            evicted = self._order.popleft()
            self.recent.discard(evicted)
            self.floor = max(self.floor, evicted + 1)
        self.unique += 1
        self.lowest = seq if self.lowest is None else min(self.lowest, seq)
        self.highest = max(self.highest, seq)
        return True

    @property
    def missing(self) -> int:
        """Numbers between the lowest and highest seen that never arrived (so far)."""
        if self.lowest is None:
            return 0
        return (self.highest - self.lowest + 1) - self.unique
