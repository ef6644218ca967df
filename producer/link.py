"""The channel thread: the only code that touches a producer's DEALER socket.

``Link.run`` is the body of the thread ``TrainerChannel`` starts. It owns the socket, its
monitor and the conversation of protocol v2 with the trainer; it talks to the producer's main
loop only through two queues: *commands* in (``Outgoing`` batches, ``Finish``, ``Shutdown``,
with a byte on a wake-up pipe so a blocked poll sees them at once) and *events* out
(``Welcomed``, ``Sent``, ``Released``, ``Dropped``, ``Drained``, and ``Failed`` carrying the
exception that ended the thread, re-raised by the owner). No state is shared otherwise.

Per connection (libzmq reconnects by itself; each connection is a new peer to the trainer):
``hello`` once the ZMTP handshake succeeded, then nothing but pings until ``welcome``; then a
batch only against credit (``welcome.credit``, then ``credit {n}``), one credit each. Credit is
0 again on a disconnect, a ``bye``, or a ``refused``/``dropped`` of reason ``no_hello`` (which
also says hello again). A ping goes whenever nothing was sent for ``PING_S``, with or without
a batch waiting, so the trainer never forgets a live producer. ``IMMEDIATE`` is on: a message
is queued only to a connected trainer, and whatever a lost connection held is dropped with it
(at-most-once delivery), never replayed to a trainer that has not heard our hello.

A batch is sent frame by frame: frames of at least ``copy_threshold`` bytes zero-copy with a
tracker, smaller ones copied (pyzmq gives those, and ``send_multipart``'s every frame but the
last, no usable tracker). A batch is *released* once every tracker is done: ZeroMQ has written
those bytes to the kernel and dropped its references, so the buffers may be rewritten.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor
from stagefeed.common import protocol
from stagefeed.common.errors import (
    BrokenError,
    ConfigError,
    DropReason,
    ProtocolError,
    StagefeedError,
)
from stagefeed.common.schema import Schema, SchemaMismatch, excerpt

log = logging.getLogger(__name__)

POLL_MS = 100  # longest a poll waits, so a stalled peer never delays a command by more
TRACKER_POLL_MS = 5  # while ZeroMQ holds a batch: how stale a release may be
PING_S = 2.0
UNREACHABLE_LOG_S = 2.0
NO_WELCOME_LOG_S = 10.0
NOTICE_EVERY_S = 5.0  # one line per reason per 5 s for drops and malformed messages
HELLO_RETRY_S = 5.0  # after a refused hello the trainer may accept later (peer_limit)
CONTROL_SLACK = 8  # send queue room for hello/ping/end beside the batches
RECV_BURST = 64
_REASONS = frozenset(r.value for r in DropReason)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclasses.dataclass(frozen=True)
class Welcome:
    """What the first welcome settled: the schema batches follow, the trainer's message cap,
    its first credit, and ``max_unsent`` (batches the channel may hold for this schema)."""

    schema: Schema
    max_message: int
    credit: int
    max_unsent: int


@dataclasses.dataclass
class Outgoing:
    """One batch: ``frames`` (header, then one buffer per array) and, once sent, trackers."""

    seq: int
    frames: list[Any]
    trackers: list[zmq.MessageTracker] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Finish:
    count: int  # the source ended after ``count`` batches: ``end {seq: count}``
    deadline: float  # monotonic; past it, report what could not be sent


@dataclasses.dataclass(frozen=True)
class Shutdown:
    linger_ms: int  # 0: discard what ZeroMQ holds; > 0: let it deliver for that long


@dataclasses.dataclass(frozen=True)
class Welcomed:
    welcome: Welcome


@dataclasses.dataclass(frozen=True)
class Sent:
    seq: int


@dataclasses.dataclass(frozen=True)
class Released:
    seq: int


@dataclasses.dataclass(frozen=True)
class Dropped:
    seq: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Drained:
    unsent: int  # batches never handed to ZeroMQ (no credit before the deadline)
    end_sent: bool


@dataclasses.dataclass(frozen=True)
class Failed:
    error: StagefeedError


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
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.schema = schema  # declared, or adopted from the first welcome; then fixed
        self._ctx = ctx
        self._max_unsent_of = max_unsent_of
        self._configure = configure
        self._commands = commands
        self._wake_fd = wake_fd
        self._events = events
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._outbox: collections.deque[Outgoing] = collections.deque()
        self._in_zmq: list[Outgoing] = []
        self._finish: Finish | None = None
        self._drained = False
        self._end_sent = False
        self._linger_ms = 0
        self._welcomed_once = False
        self._noticed: dict[str, float] = {}
        self._drops: collections.Counter[str] = collections.Counter()
        self._unreachable_since = time.monotonic()
        self._said_unreachable = False
        self._last_send = 0.0
        self._lose_connection()

    # -- thread body ---------------------------------------------------------------------------

    def run(self) -> None:
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
        batches = self._max_unsent_of(self.schema) if self.schema is not None else 0
        sock.setsockopt(zmq.SNDHWM, batches + CONTROL_SLACK)
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
        self._reap()
        self._write(now)
        self._check_finish(now)
        self._log_waiting(now)
        self._poll(now)
        return True

    # -- commands and releases -----------------------------------------------------------------

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
            elif isinstance(command, Shutdown):
                self._linger_ms = command.linger_ms
                return False

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

    # -- connection state ----------------------------------------------------------------------

    def _lose_connection(self) -> None:
        self._connected = False
        self._hello_due = False
        self._hello_at: float | None = None
        self._hello_not_before = 0.0
        self._welcomed = False
        self._credit = 0
        self._bye = False
        self._said_no_welcome = False

    def _read_monitor(self, now: float) -> None:
        assert self._monitor is not None
        while self._monitor.poll(0):
            message = zmq.utils.monitor.recv_monitor_message(self._monitor)
            event = message["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._lose_connection()
                self._connected = True
                self._hello_due = True
                if self._said_unreachable:
                    log.info("trainer at %s reachable again", self.endpoint)
                self._said_unreachable = False
            elif event == zmq.EVENT_DISCONNECTED:
                if self._connected:
                    log.info("lost the trainer at %s; reconnecting", self.endpoint)
                    self._unreachable_since = now
                self._lose_connection()
            elif event & _HANDSHAKE_FAILED:
                # libzmq does not reconnect after a refused handshake: waiting would be silent
                # and endless, and only a change of keys on one side can fix it.
                raise BrokenError(
                    f"the trainer at {self.endpoint} refused the handshake "
                    f"({zmq.Event(event).name}): check --curve-keys on both sides"
                )

    def _say_hello_again(self) -> None:
        """Forget this connection's welcome and credit; hello again on the same connection."""
        connected = self._connected
        self._lose_connection()
        self._connected = connected
        self._hello_due = connected

    # -- messages from the trainer -------------------------------------------------------------

    def _read_messages(self, now: float) -> None:
        assert self._socket is not None
        for _ in range(RECV_BURST):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                self._notice("parts", f"a {len(frames)}-frame message from {self.endpoint} ignored")
                continue
            try:
                header = protocol.decode_header(frames[0], protocol.FROM_TRAINER)
            except ProtocolError as exc:
                self._notice(exc.reason.value, f"malformed message from {self.endpoint}: {exc}")
                continue
            getattr(self, f"_on_{header['t']}")(header, now)

    def _on_welcome(self, header: dict[str, Any], now: float) -> None:
        if self._hello_at is None or self._welcomed:
            log.debug("unexpected welcome from %s ignored", self.endpoint)
            return
        try:
            schema = Schema.from_dict(header["schema"], source=f"welcome from {self.endpoint}")
        except ConfigError as exc:
            raise BrokenError(str(exc)) from None
        if self.schema is not None and schema.wire() != self.schema.wire():
            raise SchemaMismatch(
                f"trainer at {self.endpoint} now expects {schema.describe()}; this producer "
                f"sends {self.schema.describe()}"
            )
        agreed = self.schema or schema
        if agreed.batch_bytes > header["max_message"]:
            raise ConfigError(
                f"trainer at {self.endpoint} accepts messages of at most {header['max_message']} "
                f"B; one batch of {agreed.describe()} is {agreed.batch_bytes} B"
            )
        self._welcomed = True
        self._credit = header["credit"]
        if not self._welcomed_once:
            self._welcomed_once = True
            self.schema = agreed
            max_unsent = self._max_unsent_of(agreed)
            assert self._socket is not None
            self._socket.setsockopt(zmq.SNDHWM, max_unsent + CONTROL_SLACK)
            welcome = Welcome(agreed, header["max_message"], header["credit"], max_unsent)
            self._events.put(Welcomed(welcome))
        else:
            log.info("trainer at %s welcomed us again (credit %d)", self.endpoint, self._credit)

    def _on_refused(self, header: dict[str, Any], now: float) -> None:
        reason = header["reason"]
        detail = _one_line(header["detail"])
        if reason == DropReason.NO_HELLO:
            self._notice(reason, f"trainer at {self.endpoint} does not know us: hello again")
            self._say_hello_again()
        elif reason == DropReason.PEER_LIMIT:
            self._notice(reason, f"trainer at {self.endpoint} is full ({detail}); retrying")
            self._say_hello_again()
            self._hello_not_before = now + HELLO_RETRY_S
        elif reason == DropReason.SPEC_MISMATCH:
            raise SchemaMismatch(f"trainer at {self.endpoint}: {detail}")
        else:
            raise ConfigError(
                f"trainer at {self.endpoint} refused this producer ({excerpt(reason)}): {detail}"
            )

    def _on_credit(self, header: dict[str, Any], now: float) -> None:
        if self._welcomed:
            self._credit = min(self._credit + header["n"], 2**20)

    def _on_dropped(self, header: dict[str, Any], now: float) -> None:
        reason = header["reason"] if header["reason"] in _REASONS else "other"
        self._drops[reason] += 1
        self._events.put(Dropped(header["seq"], reason))
        self._notice(
            f"dropped:{reason}",
            f"trainer at {self.endpoint} dropped batch {header['seq']}: {reason}: "
            f"{_one_line(header['detail'])} ({self._drops[reason]} so far)",
        )
        if reason == DropReason.NO_HELLO and self._welcomed:
            self._say_hello_again()

    def _on_bye(self, header: dict[str, Any], now: float) -> None:
        self._credit = 0
        if not self._bye:
            self._bye = True
            log.info("trainer at %s is closing; waiting for it to come back", self.endpoint)

    # -- sending -------------------------------------------------------------------------------

    def _write(self, now: float) -> None:
        if not self._connected:
            return
        if self._hello_due and now >= self._hello_not_before:
            declared = self.schema.to_dict() if self.schema is not None else None
            if not self._send_control("hello", name=self.name, schema=declared):
                return
            self._hello_due = False
            self._hello_at = now
        if not self._welcomed:
            return
        while self._credit > 0 and self._outbox:
            if not self._send_batch(self._outbox[0]):
                return
            out = self._outbox.popleft()
            self._credit -= 1
            self._events.put(Sent(out.seq))
            if out.trackers:
                self._in_zmq.append(out)
            else:  # every frame was copied: no buffer of ours is left in ZeroMQ
                out.frames = []
                self._events.put(Released(out.seq))
        if self._finish is not None and not self._outbox and not self._end_sent:
            if not self._send_control("end", seq=self._finish.count):
                return
            self._end_sent = True
        if now - self._last_send >= PING_S:
            self._send_control("ping")

    def _send_control(self, kind: str, **fields: Any) -> bool:
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
        try:
            self._socket.send(out.frames[0], zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            return False
        threshold = self._socket.copy_threshold
        last = len(out.frames) - 1
        for index in range(1, last + 1):
            frame = out.frames[index]
            flags = 0 if index == last else zmq.SNDMORE
            large = memoryview(frame).nbytes >= threshold
            tracker = self._send_part(frame, flags, large)
            if tracker is not None:
                out.trackers.append(tracker)
        self._last_send = time.monotonic()
        return True

    def _send_part(self, frame: Any, flags: int, large: bool) -> zmq.MessageTracker | None:
        assert self._socket is not None
        while True:
            try:
                if large:
                    return self._socket.send(
                        frame, flags | zmq.NOBLOCK, copy=False, track=True
                    )
                self._socket.send(frame, flags | zmq.NOBLOCK)
                return None
            except zmq.Again:
                self._socket.poll(POLL_MS, zmq.POLLOUT)

    # -- finishing, logging, waiting -----------------------------------------------------------

    def _check_finish(self, now: float) -> None:
        if self._finish is None or self._drained:
            return
        if self._end_sent or now >= self._finish.deadline:
            self._drained = True
            self._events.put(Drained(len(self._outbox), self._end_sent))

    def _log_waiting(self, now: float) -> None:
        if (
            not self._connected
            and not self._said_unreachable
            and now - self._unreachable_since > UNREACHABLE_LOG_S
        ):
            self._said_unreachable = True
            log.warning("cannot reach the trainer at %s; retrying quietly", self.endpoint)
        if (
            self._hello_at is not None
            and not self._welcomed
            and not self._said_no_welcome
            and now - self._hello_at > NO_WELCOME_LOG_S
        ):
            self._said_no_welcome = True
            log.warning(
                "no welcome from %s %.0f s after hello: is it a stagefeed trainer (protocol v%d)?",
                self.endpoint,
                NO_WELCOME_LOG_S,
                protocol.PROTOCOL_VERSION,
            )

    def _notice(self, key: str, message: str) -> None:
        """Log ``message`` unless a line of the same ``key`` went out in the last 5 s."""
        now = time.monotonic()
        if now - self._noticed.get(key, -NOTICE_EVERY_S) >= NOTICE_EVERY_S:
            self._noticed[key] = now
            log.warning("%s", message)

    def _poll(self, now: float) -> None:
        assert self._socket is not None
        timeout = TRACKER_POLL_MS if self._in_zmq else POLL_MS
        writable_wanted = False
        if self._connected:
            if self._hello_due:
                if now >= self._hello_not_before:
                    writable_wanted = True
                else:
                    timeout = min(timeout, (self._hello_not_before - now) * 1000)
            if self._welcomed:
                ping_in = self._last_send + PING_S - now
                writable_wanted |= ping_in <= 0 or bool(self._credit and self._outbox)
                writable_wanted |= self._finish is not None and not self._end_sent
                if ping_in > 0:
                    timeout = min(timeout, ping_in * 1000)
        if self._finish is not None and not self._drained:
            timeout = min(timeout, max(0.0, self._finish.deadline - now) * 1000)
        flags = zmq.POLLIN | (zmq.POLLOUT if writable_wanted else 0)
        self._poller.register(self._socket, flags)
        self._poller.poll(max(1, int(timeout)))


def _one_line(text: str) -> str:
    """Untrusted detail text as one bounded, printable line."""
    text = text[: protocol.MAX_DETAIL_LEN]
    return "".join(c if c.isprintable() else " " for c in text)
