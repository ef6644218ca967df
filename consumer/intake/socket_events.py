"""Connection events on the trainer's bound socket, counted in the ledger.

Some peers never get a message through, so the message counters cannot see them: a producer
that fails the CURVE handshake, or one that sends a message over ``--max-message-mb`` (ZeroMQ
rejects it from the frame header, before allocating, and disconnects that peer). A ZeroMQ
socket monitor reports what happens to connections, and this module books it.

What can and cannot be attributed: libzmq reports handshake failures by kind (authentication,
protocol, no detail), so CURVE refusals are counted exactly. A peer cut off for an oversized
message is reported as a plain ``disconnected``, the same event as a producer that exits; the
monitor names only the local endpoint, never the peer. So ``disconnected`` is an upper bound on
oversize rejections, and which peer it was is not known.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq
import zmq.utils.monitor

from stagefeed.common.throttle import LogThrottle
from stagefeed.consumer.books.ledger import Ledger

log = logging.getLogger(__name__)

POLL_MS = 100
THREAD_NAME = "stagefeed-peer-monitor"

EVENT_NAMES = {
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed_auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed_no_detail",
    zmq.EVENT_DISCONNECTED: "disconnected",
}
_REFUSALS = {
    "handshake_failed_auth": "its CURVE key is not on the allow-list",
    "handshake_failed_protocol": "it speaks another security mechanism or a broken protocol",
    "handshake_failed_no_detail": "the handshake failed",
}


class PeerMonitor:
    """Owns the monitor socket of ``frontend`` and a named thread that books its events.

    Lifecycle: construct in the thread that created ``frontend``, before it binds (so no
    connection goes unseen); the owner starts ``thread``, later sets ``stop``, closes
    ``frontend`` and joins the thread; ``abandon()`` instead if the thread never started.

    Invariant: the monitor socket is read, and stays open, until ``frontend`` has closed
    (its close ends with ``EVENT_MONITOR_STOPPED``). libzmq's I/O thread sends each event
    blocking, so a monitor socket that is closed or left full would stall every connection of
    ``frontend``. Events read after ``stop`` is set are not booked: they come from the
    trainer's own shutdown.
    """

    def __init__(
        self,
        frontend: zmq.Socket,
        ledger: Ledger,
        stop: threading.Event,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        mask = zmq.EVENT_MONITOR_STOPPED
        for event in EVENT_NAMES:
            mask |= event
        self._socket = frontend.get_monitor_socket(mask)
        self._ledger = ledger
        self._stop = stop
        self._on_failure = on_failure
        self._refusal_log = LogThrottle()  # one warning per kind of refusal a while
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME)

    def _run(self) -> None:
        try:
            while True:
                if not self._socket.poll(POLL_MS):
                    continue
                event = zmq.utils.monitor.recv_monitor_message(self._socket)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                name = EVENT_NAMES.get(event)
                if name is not None and not self._stop.is_set():
                    self._book(name)
        except zmq.ZMQError as exc:
            if not self._stop.is_set():  # else: the owner destroyed the context after a stuck join
                log.exception("peer monitor failed")
                self._on_failure(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the train loop, never swallowed
            log.exception("peer monitor failed")
            self._on_failure(exc)
        finally:
            self._socket.close(linger=0)

    def _book(self, name: str) -> None:
        self._ledger.peer_event(name)
        why = _REFUSALS.get(name)
        if why is None:
            return
        if not self._refusal_log.due(name):
            return
        log.warning(
            "refused a peer: %s (%s, %d so far)",
            why,
            name,
            self._ledger.peer_events().get(name, 0),
        )

    def abandon(self) -> None:
        """Close the monitor socket of a monitor that was never started (bind failed)."""
        self._socket.close(linger=0)
