"""What the producer's main loop and its channel thread pass each other, and nothing else.

Commands go to the channel thread (``Outgoing``, ``Finish``, ``Shutdown``) on a queue with a
wake-up pipe; events come back (``Welcomed``, ``Sent``, ``Released``, ``Dropped``, ``Drained``,
``Failed``) on another queue. The two threads share no other state: a failure of the channel
thread travels as a ``Failed`` event and is re-raised in the main loop.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """End the thread; ``linger_ms`` 0 discards what ZeroMQ holds, > 0 lets it deliver."""

    linger_ms: int


@dataclasses.dataclass(frozen=True)
class Welcomed:
    welcome: Welcome


@dataclasses.dataclass(frozen=True)
class Repositioned:
    """A later welcome (a trainer that came back, or a new connection) told this shard where
    to start again: ``(start, skip ranges)``. The producer rewinds its source there."""

    resume: tuple[int, list[list[int]]]


@dataclasses.dataclass(frozen=True)
class Sent:
    """Batch ``seq`` was handed to ZeroMQ (against one credit)."""

    seq: int


@dataclasses.dataclass(frozen=True)
class Released:
    """ZeroMQ let go of every buffer of batch ``seq``: they may be rewritten."""

    seq: int


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
class Failed:
    """The channel thread ended with ``error``; the owner re-raises it."""

    error: StagefeedError
