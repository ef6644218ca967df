"""A PUSH socket that sends batches zero-copy with a bound on bytes not yet sent."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import zmq
import zmq.utils.monitor
from stagefeed.common.errors import BrokenError, ClosedError

log = logging.getLogger(__name__)

POLL_MS = 100
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class BatchSender:
    """Owns one PUSH socket (used from one thread only).

    Invariant: ``len(self._unsent) <= max_unsent``: at most ``max_unsent`` messages are held by
    ZeroMQ at once, so a producer's bytes in flight are ``max_unsent x message size``. A message
    leaves ``_unsent`` when its ``MessageTracker`` says ZeroMQ released the buffers, which is what
    makes reusing the source's buffers safe.

    ``send`` blocks while the trainer is unreachable or slow (backpressure), waking every
    ``POLL_MS`` to honour ``stop``. It says once that it is waiting, not once per retry.
    It raises ``BrokenError`` if the trainer refuses the handshake (CURVE keys).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        max_unsent: int,
        stop: Any,
        *,
        configure: Any = None,
    ) -> None:
        self.endpoint = endpoint
        self.max_unsent = max_unsent
        self._stop = stop
        self._unsent: collections.deque[zmq.MessageTracker] = collections.deque()
        self._socket = ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, max_unsent)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Queue only to a connected trainer, so "not writable" means "no trainer yet".
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self._socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if configure is not None:
            configure(self._socket)
        # Connected means handshake done: a TCP connection the trainer then refuses (CURVE key
        # not allowed, plain text to a CURVE trainer) must not count as reaching it.
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        self._socket.connect(endpoint)
        self._connected = False
        self._said_unreachable = False
        self._unreachable_since = time.monotonic()
        self._closed = False

    def send(self, frames: list[Any]) -> None:
        """Queue one message; raise ``ClosedError`` if stop was requested meanwhile."""
        while len(self._unsent) >= self.max_unsent:
            self._wait_oldest()
        while True:
            self._wait_writable()
            try:
                # Never a blocking send: the trainer can vanish between poll and send, and a
                # blocking send would then ignore stop requests.
                tracker = self._socket.send_multipart(
                    frames, flags=zmq.NOBLOCK, copy=False, track=True
                )
            except zmq.Again:
                continue
            break
        self._unsent.append(tracker)

    def unsent(self) -> int:
        """Messages ZeroMQ still holds (not yet written to the socket)."""
        return sum(not tracker.done for tracker in self._unsent)

    def close(self, flush_s: float = 0.0) -> None:
        """Idempotent. ``flush_s`` > 0: let ZeroMQ deliver what it holds for up to that long
        (on ``Context.term()``); 0: unsent messages are discarded (at-most-once delivery).

        A ``MessageTracker`` being done does not mean delivered: the rest of a multipart
        message can still sit in ZeroMQ's pipe, so a clean finish needs the linger.
        """
        if not self._closed:
            self._closed = True
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=int(flush_s * 1000))

    def _wait_oldest(self) -> None:
        tracker = self._unsent[0]
        while not tracker.done:
            self._check_stop()
            try:
                tracker.wait(POLL_MS / 1000)
            except zmq.NotDone:
                pass
        self._unsent.popleft()

    def _wait_writable(self) -> None:
        # Not writable means: no trainer connected (say so once), or backpressure (silent).
        while True:
            self._read_monitor()
            if self._socket.poll(0 if not self._connected else POLL_MS, zmq.POLLOUT):
                return
            self._check_stop()
            if not self._connected:
                self._monitor.poll(POLL_MS)
                waited = time.monotonic() - self._unreachable_since
                if waited > 2.0 and not self._said_unreachable:
                    self._said_unreachable = True
                    log.warning("cannot reach the trainer at %s; retrying quietly", self.endpoint)

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
                if self._said_unreachable:
                    log.info("trainer at %s reachable again", self.endpoint)
                self._said_unreachable = False
            elif event == zmq.EVENT_DISCONNECTED:
                # Only a lost connection restarts the clock: refused handshakes repeat.
                if self._connected:
                    self._unreachable_since = time.monotonic()
                self._connected = False
            elif event & _HANDSHAKE_FAILED:
                # libzmq does not reconnect after a refused handshake: waiting would be silent
                # and endless, and only a change of keys on one side can fix it.
                raise BrokenError(
                    f"the trainer at {self.endpoint} refused the handshake "
                    f"({zmq.Event(event).name}): check --curve-keys on both sides"
                )

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise ClosedError("stop requested")
