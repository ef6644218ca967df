"""Several trainers for one producer process: a channel to each, every batch to exactly one.

Under MultiWorkerMirroredStrategy each trainer worker binds its own feed and trains on what it
receives, in lockstep with the others: the slowest worker sets the pace, and one left without
data stalls them all (docs/scaling.md, "Producers and several trainers"). ``Fanout`` keeps one
``TrainerChannel`` per endpoint, each with its own hello, welcome, credit and sequence numbers,
so each trainer sees an ordinary producer (its books and gap detection unchanged), and offers
the producer's main loop the calls of a single ``TrainerChannel`` (``Channel``,
``producer.channel_contract``).

Assignment: a batch goes to a channel only against credit its trainer gave that no batch
already handed over will use (``TrainerChannel.free_credit``): to the channel with the most,
ties to the one holding fewest batches, then in turn. A trainer grants credit as it takes
batches in, so a fast one gets more; a slow one, one that is down (credit 0 while its channel
reconnects) or one that has not welcomed us yet gets none, and holds nobody up. A batch waits
in the producer (in ``send``) until some trainer has credit, never in the channel of a trainer
that may be gone.

Hand-back: a connection lost while its channel still holds batches not yet given to ZeroMQ
hands them back (``hand_back``): they go to the next channel with credit, renumbered in its
sequence. So no batch goes to two trainers, and none waits for a trainer that is gone. What
ZeroMQ already held for the lost connection is lost with it (at most once, as with one
trainer); a descriptor of a shared-memory slot stays with its channel (the slot is in that
trainer's pool).

Bounds: the batches held over all channels, plus those handed back, stay at most
``max_unsent``: the memory bound of one channel (docs/guarantees.md).

End: ``finish`` first places the batches handed back, then sends ``end`` on every channel that
was welcomed, each with its own count; a trainer that is down gets its ``end`` if it comes back
before the deadline. Schema: the first welcome settles it; a trainer that welcomes another
one is a ``SchemaMismatch``.

Threads: every method runs in the owner's thread; each channel has its own thread, and every
channel sets one ``threading.Event`` when it posts an event, which is what ``_wait`` waits on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from stagefeed.common.errors import ClosedError
from stagefeed.common.options import ProducerOptions
from stagefeed.common.schema import Schema, SchemaMismatch
from stagefeed.common.shm.slots import SlotPool
from stagefeed.producer.channel import POLL_S, OnRelease, TrainerChannel
from stagefeed.producer.channel_contract import Channel
from stagefeed.producer.handoff import Drained, Outgoing, Welcome
from stagefeed.producer.shm_lane import ShmLane

log = logging.getLogger(__name__)

SLOT_WAIT_S = 0.02  # how long a slot of the chosen trainer's pool is waited for, per try


class Fanout:
    """One producer's channels to the trainers at ``endpoints`` (see the module docstring).
    The arguments are ``TrainerChannel``'s."""

    def __init__(
        self,
        endpoints: Sequence[str],
        name: str,
        schema: Schema | None = None,
        *,
        max_unsent: int | Callable[[Schema], int],
        configure: Callable[[zmq.Socket], None] | None = None,
        transport: str = "zmq",
        heartbeat_timeout_s: float = 0.0,
    ) -> None:
        self.endpoint = ", ".join(endpoints)
        self.name = name
        self._wake = threading.Event()
        self.channels: list[TrainerChannel] = []
        self.welcome: Welcome | None = None
        self.repositioned: tuple[int, list[list[int]]] | None = None  # never: see make_channel
        self._returned: list[tuple[Outgoing, OnRelease]] = []
        self._turn = 0
        self._slot_channel: int | None = None
        self._closed = False
        try:
            for endpoint in endpoints:
                self.channels.append(
                    TrainerChannel(
                        endpoint, name, schema, max_unsent=max_unsent, configure=configure,
                        transport=transport, heartbeat_timeout_s=heartbeat_timeout_s,
                        hand_back=True, notify=self._wake,
                    )  # fmt: skip
                )
        except BaseException:
            self.close()
            raise
        self._next_seq = [0] * len(self.channels)
        self._admitted = [False] * len(self.channels)  # welcomed with the agreed schema

    @property
    def lane(self) -> ShmLane | None:
        """Not None when batches may go in shared memory (each channel has its own lane)."""
        return next((c.lane for c in self.channels if c.lane is not None), None)

    # -- the owner's calls (``TrainerChannel``'s) ----------------------------------------------

    def open(self, stop: Any) -> Welcome:
        """Connect to every trainer; return once the first has welcomed us."""
        for channel in self.channels:
            channel.start()
        self._poll()
        while self.welcome is None:
            self._wait(stop)
        return self.welcome

    def send(
        self, arrays: Mapping[str, np.ndarray], seq: int, stop: Any, on_release: OnRelease = None
    ) -> None:
        """Hand batch ``seq`` (the producer's count; each channel numbers its own) to the
        trainer with the most free credit, waiting until one has some."""
        index = self._next_channel(stop)
        self.channels[index].send(arrays, self._next_seq[index], stop, on_release)
        self._next_seq[index] += 1

    def acquire_slot(self, stop: Any) -> tuple[SlotPool, int] | None:
        """A slot in the pool of the trainer this batch goes to; None: send it over ZeroMQ."""
        while True:
            if stop.is_set():
                raise ClosedError("stop requested")
            index = self._next_channel(stop)
            lane = self.channels[index].lane
            if lane is None:
                return None
            try:
                got = lane.acquire(SLOT_WAIT_S)
            except TimeoutError:
                continue  # no slot free (or no pool yet): choose again
            if got is not None:
                self._slot_channel = index
            return got

    def commit_slot(self, pool: SlotPool, slot: int, seq: int) -> dict[str, Any] | None:
        """The descriptor of the filled slot, numbered in its channel; None if the pool was
        retired meanwhile (that batch is lost with the trainer it was for)."""
        assert self._slot_channel is not None
        index = self._slot_channel
        return self.channels[index].commit_slot(pool, slot, self._next_seq[index])

    def send_descriptor(self, desc: dict[str, Any], seq: int, stop: Any) -> None:
        assert self._slot_channel is not None
        index, self._slot_channel = self._slot_channel, None
        self.channels[index].send_descriptor(desc, desc["seq"], stop)
        self._next_seq[index] += 1

    def discard_slot(self, pool: SlotPool, slot: int) -> None:
        assert self._slot_channel is not None
        index, self._slot_channel = self._slot_channel, None
        self.channels[index].discard_slot(pool, slot)

    def held(self) -> int:
        return sum(c.held() for c in self.channels) + len(self._returned)

    def waiting(self) -> int:
        return sum(c.waiting() for c in self.channels) + len(self._returned)

    def in_zeromq(self) -> int:
        return sum(c.in_zeromq() for c in self.channels)

    def refused(self) -> dict[str, int]:
        total: collections.Counter[str] = collections.Counter()
        for channel in self.channels:
            total.update(channel.refused())
        return dict(total)

    def trainers(self) -> dict[str, dict[str, int]]:
        """Per trainer endpoint: batches given to ZeroMQ for it, connections to it lost."""
        return {e: n for c in self.channels for e, n in c.trainers().items()}

    def finish(
        self, count: int, stop: Any, timeout_s: float, reason: str = "ok", detail: str = "",
        bad: tuple[int, str] = (0, ""),
    ) -> Drained:
        """Place what was handed back, then ``end`` on every welcomed channel (with its own
        count), for up to ``timeout_s`` in all. ``count`` is the producer's total."""
        deadline = time.monotonic() + timeout_s
        while self._returned and time.monotonic() < deadline:
            self._place_returned(stop)
            if self._returned:
                self._wait(stop)
        unsent = self._give_up_returned()
        ending = [i for i, admitted in enumerate(self._admitted) if admitted]
        for index in ending:
            self.channels[index].begin_finish(
                self._next_seq[index], deadline, reason, detail, bad
            )
        while any(self.channels[i].drained is None for i in ending):
            self._wait(stop)
            unsent += self._give_up_returned()  # handed back before the channel had Finish
        drained = [self.channels[i].drained for i in ending]
        for index, channel in enumerate(self.channels):
            count, done = self._next_seq[index], channel.drained
            log.info(
                "producer %s: %d batches to the trainer at %s (%s), end %s",
                self.name, count, channel.endpoint,
                f"seq 0..{count - 1}" if count else "none",
                "sent" if done is not None and done.end_sent else "not sent",
            )  # fmt: skip
        return Drained(
            unsent + sum(d.unsent for d in drained if d is not None),
            all(d is not None and d.end_sent for d in drained),
        )

    def close(self, linger_s: float = 0.0) -> None:
        """Close every channel, letting ZeroMQ deliver for up to ``linger_s`` in all."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + linger_s
        for channel in self.channels:
            channel.close(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _poll(self) -> None:
        """Every channel's events; its failure raised; welcomes checked; batches handed back
        collected."""
        for index, channel in enumerate(self.channels):
            channel.poll()
            self._returned.extend(channel.take_returned())
            welcome = channel.welcome
            if welcome is None or self._admitted[index]:
                continue
            if self.welcome is None:
                self.welcome = welcome
            elif welcome.schema.wire() != self.welcome.schema.wire():
                raise SchemaMismatch(
                    f"the trainer at {channel.endpoint} expects {welcome.schema.describe()}; "
                    f"another one welcomed this producer with {self.welcome.schema.describe()}"
                )
            self._admitted[index] = True

    def _wait(self, stop: Any) -> None:
        """Until some channel posts an event, or ``POLL_S``; then ``_poll``."""
        if stop.is_set():
            raise ClosedError("stop requested")
        self._wake.wait(POLL_S)
        self._wake.clear()
        self._poll()

    def _pick(self) -> int | None:
        """The channel with the most free credit (then fewest held, then in turn), if any."""
        best: int | None = None
        best_key = (0, 0)
        count = len(self.channels)
        for k in range(count):
            index = (self._turn + k) % count
            channel = self.channels[index]
            free = channel.free_credit() if self._admitted[index] else 0
            key = (free, -channel.held())
            if free > 0 and (best is None or key > best_key):
                best, best_key = index, key
        if best is not None:
            self._turn = (best + 1) % count
        return best

    def _next_channel(self, stop: Any) -> int:
        """The channel the next batch goes to, once one has free credit and fewer than
        ``max_unsent`` batches are held (batches handed back are placed first)."""
        self._poll()
        while True:
            self._place_returned(stop)
            assert self.welcome is not None, "open() must succeed before sending"
            if not self._returned and self.held() < self.welcome.max_unsent:
                index = self._pick()
                if index is not None:
                    return index
            self._wait(stop)

    def _place_returned(self, stop: Any) -> None:
        while self._returned:
            index = self._pick()
            if index is None:
                return
            out, on_release = self._returned.pop(0)
            self.channels[index].resend(out, self._next_seq[index], stop, on_release)
            self._next_seq[index] += 1

    def _give_up_returned(self) -> int:
        """Batches handed back that will not be sent now: their buffers are released."""
        returned = self._returned + [r for c in self.channels for r in c.take_returned()]
        self._returned = []
        for _out, on_release in returned:
            if on_release is not None:
                on_release()
        return len(returned)


def make_channel(
    options: ProducerOptions,
    name: str,
    configure: Callable[[zmq.Socket], None] | None,
    hello_fields: dict[str, Any] | None = None,
) -> Channel:
    """The channel of one producer process: to its one trainer, or a fan-out to several.

    ``hello_fields`` (the shard's identity, for resume: docs/resume.md) go to a single trainer
    only: a shard's position spread over several trainers is not kept (a fan-out's trainers
    see an unsharded producer, so none claims an exact position for it)."""
    settings: dict[str, Any] = {
        "max_unsent": options.max_unsent,
        "configure": configure,
        "transport": options.transport,
        "heartbeat_timeout_s": options.heartbeat_timeout_s,
    }
    if len(options.connect) == 1:
        return TrainerChannel(
            options.connect[0], name, options.schema, hello_fields=hello_fields, **settings
        )
    return Fanout(options.connect, name, options.schema, **settings)
