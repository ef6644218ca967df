"""What the producer's main loop and its channel thread pass each other, and nothing else.

Commands go to the channel thread (``Outgoing``, ``EndPass``, ``Finish``, ``CloseChannel``)
on a queue with a wake-up pipe; events come back (``Welcomed``, ``Credit``, ``Sent``,
``Released``, ``Returned``, ``Dropped``, ``Lost``, ``NextPass``, ``Drained``, ``Failed``) on an
``EventQueue``. The two
threads share no other state: a failure of the channel thread travels as a ``Failed`` event
and is re-raised in the main loop.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any

import zmq

from stagefeed.common.errors import StagefeedError
from stagefeed.common.schema import Schema


@dataclasses.dataclass(frozen=True)
class Welcome:
    """What the first welcome settled: the schema batches follow, the trainer's message cap,
    its first credit, and ``max_unsent`` (batches the channel may hold for this schema);
    ``resume``: where this shard starts, ``(start, skip ranges)``, from a trainer that books
    input positions (docs/resume.md), else None."""

    schema: Schema
    max_message: int
    credit: int
    max_unsent: int
    resume: tuple[int, list[list[int]]] | None = None
    # To a hello that said ``passes``: ``(pass, pass_start, pass_count)`` (docs/resume.md).
    passes: tuple[int, int, int] | None = None
    # To a hello that said ``confirm``: the trainer will say ``saved`` once a checkpoint holds
    # this shard whole; until then a finished producer stays (docs/resume.md).
    confirm: bool = False


@dataclasses.dataclass
class Outgoing:
    """One batch: ``frames`` (header, then one buffer per array; a ``shm_batch`` header alone)
    and, once sent, the trackers of its zero-copy frames. Owned by the channel thread once
    handed over."""

    seq: int
    frames: list[Any]
    trackers: list[zmq.MessageTracker] = dataclasses.field(default_factory=list)
    pool: str | None = None  # a shm_batch: the pool its slot is in


@dataclasses.dataclass(frozen=True)
class Finish:
    """The producer is done after ``count`` batches: send what is held, then ``end {seq:
    count}`` with ``reason`` and ``detail`` unless the reason is ``ok`` (``protocol``: an
    ``end`` without one means ok); past ``deadline`` (monotonic), report what could not be
    sent instead."""

    count: int
    deadline: float
    reason: str = "ok"
    detail: str = ""
    bad: tuple[int, str] = (0, "")  # records the source skipped, and the first one named


@dataclasses.dataclass(frozen=True)
class EndPass:
    """Pass ``pass_`` ended at batch ``seq``: ``end_pass`` once every batch before it went,
    and again after each later welcome, until the trainer moves past that pass."""

    seq: int
    pass_: int


@dataclasses.dataclass(frozen=True)
class NextPass:
    """The trainer is in pass ``pass_`` (its ``next_pass``, or a later welcome)."""

    pass_: int


@dataclasses.dataclass(frozen=True)
class CloseChannel:
    """End the channel thread; ``linger_ms`` 0 discards what ZeroMQ holds, > 0 lets it
    deliver. (Not ``common.lifecycle.Shutdown``, which turns a process's signals into a stop.)"""

    linger_ms: int


@dataclasses.dataclass(frozen=True)
class Welcomed:
    welcome: Welcome


@dataclasses.dataclass(frozen=True)
class Credit:
    """The trainer's unspent credit is now ``n`` (0 while the connection is down or not yet
    welcomed): posted on every change, before the ``Sent`` of a batch that spent one."""

    n: int


@dataclasses.dataclass(frozen=True)
class Lost:
    """The connection to the trainer was lost: closed, or silent past the heartbeat timeout."""


@dataclasses.dataclass(frozen=True)
class Returned:
    """A channel made to hand batches back (``producer.fanout``) lost its trainer before
    giving ``out`` to ZeroMQ: ``out`` was never sent and is the owner's again."""

    out: Outgoing


@dataclasses.dataclass(frozen=True)
class Repositioned:
    """A later welcome (a trainer that came back, or a new connection) told this shard where
    to start again: ``(start, skip ranges)``. The producer rewinds its source there."""

    resume: tuple[int, list[list[int]]]


@dataclasses.dataclass(frozen=True)
class Saved:
    """The trainer's ``saved {seq}``: a complete checkpoint holds this shard's whole stream,
    which ends at ``seq``. None: nothing to wait for any more (the trainer's run finished, or
    a later welcome did not say ``confirm``: the trainer there will not say it)."""

    seq: int | None


@dataclasses.dataclass(frozen=True)
class Sent:
    """Batch ``seq`` was handed to ZeroMQ (against one credit)."""

    seq: int


@dataclasses.dataclass(frozen=True)
class Released:
    """ZeroMQ let go of every buffer of batch ``seq``: they may be rewritten. ``sent``: False
    for a batch discarded unsent (stale after a rewind), which ZeroMQ never held."""

    seq: int
    sent: bool = True


@dataclasses.dataclass(frozen=True)
class Dropped:
    """The trainer refused batch ``seq`` (a ``DropReason`` value, or ``other``)."""

    seq: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Drained:
    """After ``Finish``: ``unsent`` batches were never handed to ZeroMQ (no credit before the
    deadline); ``end_sent`` tells whether ``end`` went (only when nothing was left)."""

    unsent: int
    end_sent: bool


@dataclasses.dataclass(frozen=True)
class EndRead:
    """The trainer's ``ended {seq}``: it read this producer's ``end`` (and every batch before
    it), so closing loses nothing. None: none will come (the trainer said ``bye``)."""

    seq: int | None


@dataclasses.dataclass(frozen=True)
class Failed:
    """The channel thread ended with ``error``; the owner re-raises it."""

    error: StagefeedError


class EventQueue:
    """The channel thread's events to its owner; ``put`` also sets ``notify``, if given (an
    owner of several channels waits for any of them: ``producer.fanout``)."""

    def __init__(self, notify: threading.Event | None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._notify = notify

    def put(self, event: object) -> None:
        self._queue.put(event)
        if self._notify is not None:
            self._notify.set()

    def get(self, timeout: float) -> object:
        return self._queue.get(timeout=timeout)

    def get_nowait(self) -> object:
        return self._queue.get_nowait()

    def empty(self) -> bool:
        return self._queue.empty()
