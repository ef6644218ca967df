"""What the channel's thread reported, as the channel's owner sees it: counts and verdicts.

``LinkReports._handle(event)`` is the one place where an event of ``producer.handoff`` changes
the owner's state; ``producer.channel.TrainerChannel`` builds on it and reads these fields.
Events arrive in the order the thread posted them, and only the owner's thread handles them.

Invariants: ``_released <= _accepted``, ``_sent <= _accepted``; ``_discarded <= _released``
(released without being sent: stale after a rewind); ``on_release`` of a batch is popped
exactly once, by its ``Released`` or its ``Returned``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from stagefeed.producer.handoff import (
    Credit,
    Drained,
    Dropped,
    EndRead,
    Failed,
    Lost,
    NextPass,
    Outgoing,
    Released,
    Repositioned,
    Returned,
    Saved,
    Sent,
    Welcome,
    Welcomed,
)

OnRelease = Callable[[], None] | None


class LinkReports:
    """The owner's books of one channel, kept from the thread's events (module docstring)."""

    def __init__(self) -> None:
        self.welcome: Welcome | None = None
        # The latest ``Repositioned`` since ``open``: a later welcome moved this shard.
        self.repositioned: tuple[int, list[list[int]]] | None = None
        self.trainer_pass = 0  # the pass the trainer is in (``NextPass``)
        self.confirms = False  # the trainer will say ``saved`` (its welcome said ``confirm``)
        self.saved: int | None = None  # the end of the stream a complete checkpoint holds
        # After ``finish``: the trainer read our ``end`` (True), or said ``bye`` (False).
        self.end_read: bool | None = None
        self._end_seq: int | None = None  # the ``end {seq}`` that ``finish`` sends
        self._accepted = 0
        self._sent = 0
        self._released = 0
        self._discarded = 0  # released without being sent (stale after a rewind)
        self._on_release: dict[int, OnRelease] = {}
        self._credit = 0
        self.lost = 0  # connections to the trainer lost so far
        self._returned: list[tuple[Outgoing, OnRelease]] = []
        self._refused: collections.Counter[str] = collections.Counter()
        self.drained: Drained | None = None
        self._failure: BaseException | None = None

    def _handle(self, event: object, reraise: bool = True) -> None:
        if isinstance(event, Released):
            self._released += 1
            self._discarded += not event.sent
            callback = self._on_release.pop(event.seq, None)
            if callback is not None:
                callback()
        elif isinstance(event, Credit):
            self._credit = event.n
        elif isinstance(event, Sent):
            self._sent += 1
        elif isinstance(event, Returned):
            self._accepted -= 1
            self._returned.append((event.out, self._on_release.pop(event.out.seq, None)))
        elif isinstance(event, Lost):
            self.lost += 1
        elif isinstance(event, Dropped):
            self._refused[event.reason] += 1
        elif isinstance(event, Welcomed):
            self.welcome = event.welcome
            self.trainer_pass = event.welcome.passes[0] if event.welcome.passes else 0
            self.confirms = event.welcome.confirm
        elif isinstance(event, NextPass):
            self.trainer_pass = max(self.trainer_pass, event.pass_)
        elif isinstance(event, Repositioned):
            self.repositioned = event.resume
        elif isinstance(event, Saved) and event.seq is None:
            self.confirms = False  # a finished run's bye, or a trainer that will not confirm
        elif isinstance(event, Saved):
            self.saved, self.confirms = event.seq, True
        elif isinstance(event, Drained):
            self.drained = event
        elif isinstance(event, EndRead) and self.drained is not None:
            # Events come in order: only a ``bye`` after our ``end`` went says it is not read.
            if event.seq is not None and event.seq == self._end_seq:
                self.end_read = True
            elif event.seq is None and self.end_read is None:
                self.end_read = False
        elif isinstance(event, Failed):
            self._failure = event.error
            if reraise:
                raise event.error
