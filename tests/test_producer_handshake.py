"""Covers ``producer/link.py``'s reading of the handshake events: a trainer that closes the
connection during the ZeroMQ handshake (it is ending, or restarting) is a lost connection to
retry when there are no CURVE keys, not a refused key (``run``'s second producer, starting
while its trainer ended a 10-step run, exited 3: "refused the handshake ... check
--curve-keys")."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.helpers.procs import log_text

SOURCE = ["--schema", "tests.helpers.regression_models:SCHEMA",
          "--source", "tests.helpers.regression_models:sums", "--workers", "1"]  # fmt: skip


@pytest.fixture
def closing_listener() -> Iterator[int]:
    """A TCP port whose every connection is accepted and closed at once, mid-handshake."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()
    accepted = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            conn.close()

    thread = threading.Thread(target=serve, name="closing-listener", daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()
    assert accepted, "the producer never connected"


def test_a_trainer_closing_during_the_handshake_is_retried_not_a_refused_key(
    spawn, closing_listener
):
    producer = spawn(["produce", "--connect", f"tcp://127.0.0.1:{closing_listener}", *SOURCE],
                     name="producer")  # fmt: skip
    time.sleep(4)  # several connections closed mid-handshake by then
    text = log_text(producer)
    assert producer.proc.poll() is None, text[-3000:]
    assert "refused the handshake" not in text, text[-3000:]
    producer.signal(signal.SIGINT)
    assert producer.wait(30) == 0, log_text(producer)[-3000:]
