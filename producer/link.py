"""The channel thread: the only code that touches a producer's DEALER socket.

``Link.run`` is the body of the thread ``TrainerChannel`` starts. It owns the socket and its
monitor, and does the I/O the conversation (``producer.session.Session``) calls for; it talks
to the producer's main loop only through the queues of ``producer.handoff``, with a byte on a
wake-up pipe so a poll in progress sees a command at once.

Socket: ``IMMEDIATE`` is on, so a message is queued only to a connected trainer and whatever
a lost connection held is dropped with it (at-most-once delivery), never replayed to a
trainer that has not heard our hello. ``SNDHWM`` is ``max_unsent`` plus room for control
messages; the owner's accounting, not the high-water mark, is what bounds held batches.

Sending a batch: frame by frame, frames of at least ``copy_threshold`` bytes zero-copy with a
tracker, smaller ones copied (pyzmq gives those, and ``send_multipart``'s every frame but the
last, no usable tracker). A batch is *released* once every tracker is done: ZeroMQ has written
those bytes to the kernel and dropped its references, so the buffers may be rewritten. A
batch with no large frame is released when sent: ZeroMQ holds only its own copies.

Shared memory (``lane``, ``producer.shm_lane``): after every welcome the thread hands the
welcome's offer to the lane before it writes anything, so a descriptor never precedes the
pool it names; a ``shm_batch`` waiting for credit whose pool has since been retired is not
sent (released at once; the trainer it was for is gone). A descriptor is one frame.

Liveness (``common.liveness``): ZeroMQ heartbeats and TCP keepalive on the socket, so a
trainer that vanishes without closing its connections (host down, partition) is noticed as a
lost connection after the heartbeat timeout, like one that closed them.

Hand-back (``hand_back``, for ``producer.fanout``): while the connection is not welcomed (lost,
or waiting for a welcome again) and no ``Finish`` was given, every ZeroMQ batch in the outbox
goes back to the owner as ``Returned`` instead of waiting for this trainer, so the owner can
send it to another one. A descriptor stays: its slot is in this trainer's pool.

Pings: whenever nothing was sent for ``PING_S`` on a welcomed connection, batch waiting or
not, so a trainer that forgets silent producers (~10 s) never forgets a live one, even while
the source blocks: this thread does not depend on the main loop to run.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

from stagefeed.common import liveness, protocol
from stagefeed.common.errors import BrokenError, StagefeedError
from stagefeed.common.schema import Schema
from stagefeed.producer.handoff import (
    CloseChannel,
    Drained,
    EndPass,
    Failed,
    Finish,
    Outgoing,
    Released,
    Returned,
    Sent,
)
from stagefeed.producer.session import Session, message_bytes
from stagefeed.producer.shm_lane import ShmLane

log = logging.getLogger(__name__)

POLL_MS = 100  # longest a poll waits, so nothing the thread must notice waits longer
TRACKER_POLL_MS = 5  # while ZeroMQ holds a batch: how stale a release may be
PING_S = 2.0
CONTROL_SLACK = 8  # send queue room for hello/ping/end beside the batches
RECV_BURST = 64
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class Link:
    """The state of one channel thread. Every method runs in that thread (see module doc)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        name: str,
        schema: Schema | None,
        max_unsent_of: Callable[[Schema], int],
        configure: Callable[[zmq.Socket], None] | None,
        commands: queue.SimpleQueue,
        wake_fd: int,
        events: queue.SimpleQueue,
        lane: ShmLane | None = None,
        *,
        heartbeat_timeout_s: float = 0.0,
        hand_back: bool = False,
        hello_fields: dict[str, Any] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._heartbeat_s = heartbeat_timeout_s  # 0: derived from the batch size
        self._hand_back = hand_back
        self._lane = lane
        self._welcomes_seen = 0
        self._ctx = ctx
        self._max_unsent_of = max_unsent_of
        self._configure = configure
        self._commands = commands
        self._wake_fd = wake_fd
        self._events = events
        self.session = Session(
            endpoint, name, schema, max_unsent_of, events.put,
            shm=lane is not None, on_release=lane.release if lane is not None else None,
            hello_fields=hello_fields,
        )  # fmt: skip
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._outbox: collections.deque[Outgoing] = collections.deque()
        self._in_zmq: list[Outgoing] = []
        self._finish: Finish | None = None
        self._drained = False
        self._end_sent = False
        self._end_pass: EndPass | None = None
        self._end_pass_said = 0  # the welcome count when end_pass last went
        self._linger_ms = 0
        self._last_send = 0.0

    def run(self) -> None:
        """The thread body: until ``CloseChannel``, or a failure posted as ``Failed``."""
        try:
            self._open()
            while self._step():
                pass
        except StagefeedError as exc:
            self._events.put(Failed(exc))
        except Exception as exc:  # noqa: BLE001 - carried to the owner, re-raised there
            log.exception("channel to the trainer at %s failed", self.endpoint)
            error = BrokenError(f"channel to the trainer at {self.endpoint} failed: {exc!r}")
            error.__cause__ = exc
            self._events.put(Failed(error))
        finally:
            self._close()

    def _open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        self._socket = sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_HEADER_BYTES)  # the trainer sends headers
        schema = self.session.schema
        batches = self._max_unsent_of(schema) if schema is not None else 0
        sock.setsockopt(zmq.SNDHWM, batches + CONTROL_SLACK)
        liveness.configure(sock, self._heartbeat_timeout(schema))
        if self._configure is not None:
            self._configure(sock)
        # Connected means handshake done: a TCP connection the trainer then refuses (CURVE key
        # not allowed, plain text to a CURVE trainer) must not count as reaching it.
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        sock.connect(self.endpoint)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._wake_fd, zmq.POLLIN)

    def _heartbeat_timeout(self, schema: Schema | None) -> float:
        if self._heartbeat_s:
            return self._heartbeat_s
        if schema is None:
            return liveness.UNKNOWN_SIZE_TIMEOUT_S
        return liveness.heartbeat_timeout_s(message_bytes(schema))

    def _close(self) -> None:
        if self._socket is None:
            return
        try:
            self._socket.disable_monitor()
        except zmq.ZMQError:
            pass
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._socket.close(linger=self._linger_ms)

    def _step(self) -> bool:
        """One round: commands, connection events, messages, releases, writes, then a poll."""
        if not self._read_commands():
            return False
        now = time.monotonic()
        self._read_monitor(now)
        self._read_messages(now)
        self._return_unsendable()
        self._reap()
        self._write(now)
        self._check_finish(now)
        self.session.log_waiting(now)
        self._poll(now)
        return True

    def _read_commands(self) -> bool:
        try:
            while os.read(self._wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, Outgoing):
                self._outbox.append(command)
            elif isinstance(command, Finish):
                self._finish = command
            elif isinstance(command, EndPass):
                self._end_pass, self._end_pass_said = command, -1
            elif isinstance(command, CloseChannel):
                self._linger_ms = command.linger_ms
                return False

    def _read_monitor(self, now: float) -> None:
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.session.handshake()
            elif event == zmq.EVENT_DISCONNECTED:
                self.session.disconnected(now)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._configure is None:
                # Without CURVE no key can be refused: the trainer closed the connection during
                # the handshake (it is ending or restarting), and libzmq reconnects as after
                # any lost connection. (With CURVE a wrong server key looks the same: refused.)
                self.session.disconnected(now)
            elif event & _HANDSHAKE_FAILED:
                # libzmq does not reconnect after a refused handshake: waiting would be silent
                # and endless, and only a change of keys on one side can fix it.
                raise BrokenError(
                    f"the trainer at {self.endpoint} refused the handshake "
                    f"({zmq.Event(event).name}): check --curve-keys on both sides"
                )

    def _read_messages(self, now: float) -> None:
        assert self._socket is not None
        for _ in range(RECV_BURST):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            welcome = self.session.handle(frames, now)
            if welcome is not None:  # the first: now the batch size, hence the bound, is known
                self._socket.setsockopt(zmq.SNDHWM, welcome.max_unsent + CONTROL_SLACK)
                liveness.set_timeout(self._socket, self._heartbeat_timeout(welcome.schema))
            if self._lane is not None and self.session.welcomes != self._welcomes_seen:
                self._welcomes_seen = self.session.welcomes
                assert self.session.schema is not None
                self._lane.on_welcome(self.session.shm_offer, self.session.schema)

    def _return_unsendable(self) -> None:
        """Hand-back mode: ZeroMQ batches go back to the owner while no welcomed connection
        can take them (see the module docstring)."""
        if not self._hand_back or self._finish is not None or self.session.welcomed:
            return
        kept: collections.deque[Outgoing] = collections.deque()
        for out in self._outbox:
            if out.pool is None:
                self._events.put(Returned(out))
            else:
                kept.append(out)
        self._outbox = kept

    def _reap(self) -> None:
        if not self._in_zmq:
            return
        still = []
        for out in self._in_zmq:
            if all(tracker.done for tracker in out.trackers):
                out.frames = []
                self._events.put(Released(out.seq))
            else:
                still.append(out)
        self._in_zmq = still

    def _write(self, now: float) -> None:
        session = self.session
        if not session.connected:
            return
        if session.hello_due and now >= session.hello_not_before:
            if not self._send_control("hello", **session.hello()):
                return
            session.hello_sent(now)
        if not session.welcomed:
            return
        if session.moved:
            # Held batches, an end_pass or an end from the old position must not reach the
            # trainer that moved us: an ``end`` booked there ended the shard for the new
            # connection too, which then got no credit (a resumed run of passes hung).
            return
        while session.credit > 0 and self._outbox:
            if self._stale(self._outbox[0]):
                out = self._outbox.popleft()
                out.frames = []
                self._events.put(Released(out.seq, sent=False))
                continue
            if not self._send_batch(self._outbox[0]):
                return
            out = self._outbox.popleft()
            session.spend_credit()
            self._events.put(Sent(out.seq))
            if out.trackers:
                self._in_zmq.append(out)
            else:  # every frame was copied: no buffer of ours is left in ZeroMQ
                out.frames = []
                self._events.put(Released(out.seq))
        due = self._end_pass
        if due is not None and due.pass_ < session.trainer_pass:
            self._end_pass = None  # the trainer went on
        elif due is not None and not self._outbox and self._end_pass_said != session.welcomes:
            if not self._send_control("end_pass", seq=due.seq, **{"pass": due.pass_}):
                return
            self._end_pass_said = session.welcomes  # said again on a later connection
        if self._finish is not None and not self._outbox and not self._end_sent:
            if not self._send_control("end", **_end_fields(self._finish)):
                return
            self._end_sent = True
        if session.leaving_due and self._send_control("leaving"):
            session.leaving_due = False
        if now - self._last_send >= PING_S:
            self._send_control("ping")

    def _stale(self, out: Outgoing) -> bool:
        """A descriptor of a pool retired since it was committed (a new welcome came)."""
        if out.pool is None or self._lane is None or out.pool == self._lane.pool_id:
            return False
        self.session.notice(
            "stale-pool", f"batch {out.seq} was in a pool the trainer no longer maps: not sent"
        )
        return True

    def _send_control(self, kind: str, **fields: object) -> bool:
        assert self._socket is not None
        try:
            self._socket.send(protocol.encode_control(kind, **fields), zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._last_send = time.monotonic()
        return True

    def _send_batch(self, out: Outgoing) -> bool:
        """Hand one batch to ZeroMQ, or nothing (False) if its first frame does not fit now.

        Once the first frame is accepted libzmq accepts the rest (the high-water mark counts
        whole messages; a pipe lost mid-message swallows the rest), so ``_send_part`` does not
        wait in practice; it never blocks, and polls if it ever must.
        """
        assert self._socket is not None
        more = zmq.SNDMORE if len(out.frames) > 1 else 0  # a descriptor is one frame
        try:
            self._socket.send(out.frames[0], more | zmq.NOBLOCK)
        except zmq.Again:
            return False
        threshold = self._socket.copy_threshold
        last = len(out.frames) - 1
        for index in range(1, last + 1):
            frame = out.frames[index]
            flags = 0 if index == last else zmq.SNDMORE
            tracker = self._send_part(frame, flags, memoryview(frame).nbytes >= threshold)
            if tracker is not None:
                out.trackers.append(tracker)
        self._last_send = time.monotonic()
        return True

    def _send_part(self, frame: object, flags: int, large: bool) -> zmq.MessageTracker | None:
        assert self._socket is not None
        while True:
            try:
                if large:
                    return self._socket.send(frame, flags | zmq.NOBLOCK, copy=False, track=True)
                self._socket.send(frame, flags | zmq.NOBLOCK)
                return None
            except zmq.Again:
                self._socket.poll(POLL_MS, zmq.POLLOUT)

    def _check_finish(self, now: float) -> None:
        if self._finish is None or self._drained:
            return
        if self._end_sent or now >= self._finish.deadline or self.session.moved:
            self._drained = True
            self._events.put(Drained(len(self._outbox), self._end_sent))

    def _poll(self, now: float) -> None:
        """Wait for a message, a command, writability when something is due, or a deadline."""
        assert self._socket is not None
        session = self.session
        timeout = float(TRACKER_POLL_MS if self._in_zmq else POLL_MS)
        writable_wanted = False
        if session.connected and session.hello_due:
            if now >= session.hello_not_before:
                writable_wanted = True
            else:
                timeout = min(timeout, (session.hello_not_before - now) * 1000)
        if session.connected and session.welcomed:
            ping_in = self._last_send + PING_S - now
            writable_wanted |= ping_in <= 0 or bool(session.credit and self._outbox)
            writable_wanted |= self._finish is not None and not self._end_sent
            writable_wanted |= session.leaving_due
            if ping_in > 0:
                timeout = min(timeout, ping_in * 1000)
        if self._finish is not None and not self._drained:
            timeout = min(timeout, max(0.0, self._finish.deadline - now) * 1000)
        flags = zmq.POLLIN | (zmq.POLLOUT if writable_wanted else 0)
        self._poller.register(self._socket, flags)
        self._poller.poll(max(1, int(timeout)))


def _end_fields(finish: Finish) -> dict[str, object]:
    """The ``end`` message's fields: a normal end is the ``end`` every trainer understands."""
    bad, first = finish.bad
    skipped = {"bad": bad, "bad_first": protocol.one_line(first)} if bad else {}
    if finish.reason == protocol.END_OK:
        return {"seq": finish.count, **skipped}
    detail = protocol.one_line(finish.detail)
    return {"seq": finish.count, "reason": finish.reason, "detail": detail, **skipped}
