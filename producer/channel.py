"""A producer's channel to the trainer: one DEALER socket in its own thread, protocol v2.

``TrainerChannel`` is the producer main loop's side; ``producer.link.Link`` is the thread that
owns the socket, and ``producer.session.Session`` the conversation itself (hello/welcome on
every connection, credit, pings, verdicts, bye). The two threads talk through the queues of
``producer.handoff`` only. Every error of the thread travels in the event queue and is
re-raised by the next call here that acts (torchdata style): no failure is lost, none is
read from a shared attribute.

Lifecycle: ``open(stop)`` starts the thread and waits for the first welcome (the agreed schema
and ``max_unsent``); then ``send(arrays, seq, stop)`` any number of times; then either
``finish(count, stop, timeout_s)`` (send what is left against credit, then ``end``) followed by
``close(linger_s)`` to let ZeroMQ deliver, or ``close()`` alone to discard. ``close`` is
idempotent. Every method runs in the owner's thread, and only there.

Invariants:

- held: ``held() == waiting() + in_zeromq() <= max_unsent``. A batch is held from ``send``
  until every zero-copy frame's tracker is done (ZeroMQ wrote it to the kernel and let go of
  the buffer). ``send`` blocks while ``max_unsent`` are held, so the channel never holds more
  and a producer's memory is bounded by ``max_unsent`` batches plus the one being made.
- release: ``on_release`` of a batch runs exactly once, in the owner's thread, during a later
  call to this object, and only once ZeroMQ has released the batch's buffers (or has dropped
  them with a lost connection). Buffer reuse is safe because of this.
- shared memory (``transport`` shm or auto): ``acquire_slot`` gives a slot of the pool the
  current trainer accepted (None: send over ZeroMQ instead), the caller fills it, then
  ``commit_slot`` (None if the pool was retired meanwhile: that batch is lost with the old
  trainer) and ``send_descriptor``. A descriptor is released as soon as ZeroMQ has it (one
  small frame); the slot itself comes back when the trainer's ``release`` arrives.
- waiting: a method that waits (``open``, ``send``, ``finish``) wakes every ``POLL_S`` and
  raises ``ClosedError`` as soon as ``stop.is_set()``; none ever blocks inside a socket call.

One of several (``producer.fanout``, ``hand_back=True``): the owner drives the channel without
waiting in it: ``start()``, ``poll()`` (events in, failures out; ``notify`` is set whenever an
event arrives, so one owner can wait for any of its channels), ``free_credit()`` (credit the
trainer gave that no handed batch will use), ``take_returned()`` (batches handed back by a
lost connection, with their ``on_release``), ``resend`` and ``begin_finish``/``drained``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import zmq

from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError, ClosedError, ConfigError, ProtocolError
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.schema import Schema
from stagefeed.common.shm.slots import SlotPool
from stagefeed.producer.handoff import (
    CloseChannel,
    Drained,
    EndPass,
    EventQueue,
    Finish,
    Outgoing,
    Welcome,
)
from stagefeed.producer.link import Link
from stagefeed.producer.link_reports import LinkReports, OnRelease
from stagefeed.producer.shm_lane import ShmLane, ignore_sigxfsz

log = logging.getLogger(__name__)

POLL_S = 0.1
JOIN_TIMEOUT_S = 5.0
THREAD_NAME = "stagefeed-channel"

__all__ = ["Drained", "TrainerChannel", "Welcome"]


class TrainerChannel(LinkReports):
    """The producer's connection to the trainer at ``endpoint`` (see the module docstring).

    ``name`` goes in every hello (``protocol.check_producer_name``). ``schema``: the declared
    batches, or ``None`` to adopt the trainer's. ``max_unsent``: batches the channel may hold,
    or a function of the agreed schema giving it. ``configure(socket)`` runs before connect
    (``common.curve.client_configurator``). ``heartbeat_timeout_s``: see ``common.liveness``
    (0: derived from the batch size). ``hand_back`` and ``notify``: for a fan-out (see the
    module docstring).
    """

    def __init__(
        self,
        endpoint: str,
        name: str,
        schema: Schema | None = None,
        *,
        max_unsent: int | Callable[[Schema], int],
        configure: Callable[[zmq.Socket], None] | None = None,
        transport: str = "zmq",
        heartbeat_timeout_s: float = 0.0,
        hand_back: bool = False,
        notify: threading.Event | None = None,
        hello_fields: dict[str, Any] | None = None,
    ) -> None:
        try:
            protocol.check_producer_name(name)
        except ProtocolError as exc:
            raise ConfigError(f"producer name: {exc.detail}") from None
        self.endpoint = endpoint
        self.name = name
        budget = max_unsent if callable(max_unsent) else (lambda _schema: int(max_unsent))
        self._ctx = zmq.Context(io_threads=1)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._events = EventQueue(notify)
        self.lane = ShmLane(transport, endpoint) if transport != "zmq" else None
        if self.lane is not None:
            ignore_sigxfsz()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        link = Link(
            self._ctx,
            endpoint,
            name,
            schema,
            budget,
            configure,
            self._commands,
            self._wake_read,
            self._events,
            self.lane,
            heartbeat_timeout_s=heartbeat_timeout_s,
            hand_back=hand_back,
            hello_fields=hello_fields,
        )
        # Named by its trainer: a producer fanning out has one channel thread per trainer.
        self._thread = threading.Thread(
            target=link.run, name=f"{THREAD_NAME} {endpoint}", daemon=True
        )
        super().__init__()
        self._started = False
        self._closed = False

    # -- the owner's calls ---------------------------------------------------------------------

    def open(self, stop: Any) -> Welcome:
        """Connect and wait for the first welcome; ``SchemaMismatch`` / ``ConfigError`` if the
        trainer refuses this producer, ``BrokenError`` if it refuses the handshake."""
        self.start()
        while self.welcome is None:
            self._wait(stop)
        return self.welcome

    def start(self) -> None:
        """Start the channel thread (connect), once; ``open`` waits for the welcome too."""
        if self._closed:
            raise ClosedError("channel closed")
        if not self._started:
            self._started = True
            self._thread.start()

    def poll(self) -> None:
        """Take the events that have come, without waiting; raise the channel's failure, or
        ``BrokenError`` if its thread ended without one."""
        self._drain()
        if self._started and not self._closed and not self._thread.is_alive():
            self._drain()  # its Failed may have come after the first look
            raise BrokenError(f"the channel to {self.endpoint} ended unexpectedly")

    def free_credit(self) -> int:
        """Credit no batch handed over will use (0 while the connection is down)."""
        return self._credit - (self._accepted - self._sent)

    def take_returned(self) -> list[tuple[Outgoing, OnRelease]]:
        """Batches a lost connection handed back (``hand_back``), never sent, with their
        ``on_release``: the caller's again (``resend`` them, here or elsewhere)."""
        returned, self._returned = self._returned, []
        return returned

    def resend(self, out: Outgoing, seq: int, stop: Any, on_release: OnRelease) -> None:
        """Hand over a returned batch again, as batch ``seq`` of this channel."""
        self._require_open()
        header = {**msgpack.unpackb(out.frames[0]), "seq": seq}  # our own header's bytes
        frames = [msgpack.packb(header), *out.frames[1:]]
        self._hand_over(replace(out, seq=seq, frames=frames, trackers=[]), stop, on_release)

    def send(
        self,
        arrays: Mapping[str, np.ndarray],
        seq: int,
        stop: Any,
        on_release: OnRelease = None,
    ) -> None:
        """Hand over batch ``seq``, waiting while ``max_unsent`` batches are held.

        ``arrays`` must hold C-contiguous arrays of every schema array and stay unmodified
        until ``on_release`` runs (or, without one, must not be written again at all).
        """
        welcome = self._require_open()
        frames = protocol.encode_batch(seq, [(name, arrays[name]) for name in welcome.schema.names])
        self._hand_over(Outgoing(seq, frames), stop, on_release)

    def send_descriptor(self, desc: dict[str, Any], seq: int, stop: Any) -> None:
        """Hand over batch ``seq``, committed in a slot (``commit_slot``'s descriptor)."""
        self._require_open()
        header = protocol.encode_control("shm_batch", seq=seq, desc=desc)
        self._hand_over(Outgoing(seq, [header], pool=desc["pool"]), stop, None)

    def _hand_over(self, out: Outgoing, stop: Any, on_release: OnRelease) -> None:
        welcome = self._require_open()
        if out.seq in self._on_release:
            raise ValueError(f"batch seq {out.seq} is already held")
        self._drain()
        while self._accepted - self._released >= welcome.max_unsent:
            self._wait(stop)
        self._on_release[out.seq] = on_release
        self._accepted += 1
        self._command(out)

    def acquire_slot(self, stop: Any) -> tuple[SlotPool, int] | None:
        """A slot to fill (WRITING), or None to send this batch over ZeroMQ. Waits for a free
        slot (or the trainer's first welcome); ``ClosedError`` on stop, the channel's failure
        if it failed (a trainer that refuses shared memory with transport shm)."""
        self._require_open()
        assert self.lane is not None
        while True:
            self._drain()
            if stop.is_set():
                raise ClosedError("stop requested")
            try:
                return self.lane.acquire(POLL_S)
            except TimeoutError:
                if not self._thread.is_alive() and self._events.empty():
                    raise BrokenError(f"the channel to {self.endpoint} ended") from None

    def commit_slot(self, pool: SlotPool, slot: int, seq: int) -> dict[str, Any] | None:
        """The descriptor of the filled slot; None if its pool was retired (batch lost)."""
        assert self.lane is not None
        return self.lane.commit(pool, slot, seq)

    def discard_slot(self, pool: SlotPool, slot: int) -> None:
        assert self.lane is not None
        self.lane.discard(pool, slot)

    # The four counts below never raise: a failure they see waits for the next call that
    # acts (``send``, ``finish``), so they are safe in log lines and ``finally`` blocks.

    def held(self) -> int:
        """Batches handed over and not yet released by ZeroMQ (waiting for credit included)."""
        self._drain(reraise=False)
        return self._accepted - self._released

    def waiting(self) -> int:
        """Batches handed over that the channel has not yet given to ZeroMQ (no credit yet)."""
        self._drain(reraise=False)
        return self._accepted - self._sent

    def in_zeromq(self) -> int:
        """Batches given to ZeroMQ whose buffers it still holds."""
        self._drain(reraise=False)
        return self._sent - (self._released - self._discarded)

    def refused(self) -> dict[str, int]:
        """Batches the trainer dropped so far, by reason (its ``dropped`` verdicts)."""
        self._drain(reraise=False)
        return dict(self._refused)

    def finish(
        self, count: int, stop: Any, timeout_s: float, reason: str = "ok", detail: str = "",
        bad: tuple[int, str] = (0, ""),
    ) -> Drained:
        """Send what is held against credit, then ``end {seq: count}``, for up to ``timeout_s``.

        ``reason`` (``protocol.END_*``) and ``detail`` tell the trainer why this producer
        leaves (``source_error`` and the error's text; ``ok`` sends the plain ``end``);
        ``bad``: the records its source skipped, and the first one named (``protocol``).
        Returns how many batches could not be sent (``end`` goes only if none is left).
        Afterwards ``close(linger_s)`` lets ZeroMQ deliver what it holds.
        """
        self.begin_finish(count, time.monotonic() + timeout_s, reason, detail, bad)
        while self.drained is None:
            self._wait(stop)
        return self.drained

    def end_pass(self, seq: int, pass_: int, stop: Any, wait: bool = True) -> None:
        """Say pass ``pass_`` ended at ``seq`` (after what is held); with ``wait``, wait until
        the trainer is in a later pass or moved this shard (``repositioned``)."""
        self._require_open()
        self._command(EndPass(seq, pass_))
        while wait and self.trainer_pass <= pass_ and self.repositioned is None:
            self._wait(stop)

    def wait_saved(self, end: int, stop: Any) -> bool:
        """After ``finish``: wait until the trainer says a checkpoint holds this shard's whole
        stream (ending at ``end``); True then. False at once if it will not say so, or as soon
        as a later welcome moved this shard (``repositioned``) or stopped confirming."""
        while self.confirms and self.saved != end and self.repositioned is None:
            self._wait(stop)
        return self.saved == end

    def begin_finish(
        self, count: int, deadline: float, reason: str, detail: str,
        bad: tuple[int, str] = (0, ""),
    ) -> None:  # fmt: skip
        """``finish`` without waiting: ``drained`` is set once it is done."""
        self._require_open()
        self._end_seq = count
        self._command(Finish(count, deadline, reason, detail, bad))

    def trainers(self) -> dict[str, dict[str, int]]:
        """``{endpoint: {"sent": batches given to ZeroMQ, "lost": connections lost}}``."""
        self._drain(reraise=False)
        return {self.endpoint: {"sent": self._sent, "lost": self.lost}}

    def close(self, linger_s: float = 0.0) -> None:
        """Stop the thread; ``linger_s`` > 0 lets ZeroMQ deliver for up to that long (this
        call then blocks in ``Context.term``), 0 discards. After an ``end`` that went, the
        linger first waits for the trainer's ``ended`` (``protocol``: a connection closed before
        the trainer read our tail can lose it). Idempotent; never raises the channel's failure
        (the calls before it did)."""
        if self._closed:
            return
        if linger_s > 0:
            self._wait_end_read(time.monotonic() + linger_s)
        self._closed = True
        stuck: list[str] = []
        if self._thread.is_alive():
            self._command(CloseChannel(max(0, int(linger_s * 1000))))
            stuck = join_threads([self._thread], JOIN_TIMEOUT_S)
        self._drain(reraise=False)
        if self.lane is not None and not stuck:
            self.lane.close()
        if not stuck:
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._ctx.term()  # returns once the socket's linger is over

    def _wait_end_read(self, deadline: float) -> None:
        """Until the trainer read our ``end`` (``ended``), said ``bye``, or ``deadline``."""
        if self.drained is None or not self.drained.end_sent:
            return
        while self.end_read is None and self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("producer %s: the trainer at %s did not say it read our end within "
                            "the linger: the last batches may not have reached it",
                            self.name, self.endpoint)  # fmt: skip
                return
            try:
                event = self._events.get(timeout=min(POLL_S, left))
            except queue.Empty:
                continue
            self._handle(event, reraise=False)

    def __enter__(self) -> TrainerChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _require_open(self) -> Welcome:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ClosedError("channel closed")
        if self.welcome is None:
            raise RuntimeError("TrainerChannel.open() must succeed before sending")
        return self.welcome

    def _command(self, command: object) -> None:
        self._commands.put(command)
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will look

    def _wait(self, stop: Any) -> None:
        """Handle the next event, or return after ``POLL_S``; raise on failure or stop."""
        if self._failure is not None:
            raise self._failure
        if stop.is_set():
            raise ClosedError("stop requested")
        try:
            event = self._events.get(timeout=POLL_S)
        except queue.Empty:
            if not self._thread.is_alive() and self._events.empty():
                raise BrokenError(f"the channel to {self.endpoint} ended unexpectedly") from None
            return
        self._handle(event)
        self._drain()

    def _drain(self, reraise: bool = True) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            self._handle(event, reraise=reraise)
        if reraise and self._failure is not None:
            raise self._failure
