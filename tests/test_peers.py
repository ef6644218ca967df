"""``consumer.intake.socket_events``: connection events of the trainer's bound socket, booked
in the ledger."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import zmq

from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.socket_events import THREAD_NAME, PeerMonitor
from stagefeed.keygen import write_keys
from tests.conftest import wait_for


class Bound:
    """A bound PULL socket with its PeerMonitor running, as the intake binds its ROUTER."""

    def __init__(self, configure=None) -> None:
        self.ctx = zmq.Context()
        self.ledger = Ledger()
        self.stop = threading.Event()
        self.failures: list[BaseException] = []
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        if configure is not None:
            configure(self.sock)
        self.monitor = PeerMonitor(self.sock, self.ledger, self.stop, self.failures.append)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.monitor.thread.start()

    def close(self) -> None:
        """As the intake does: stop, close the socket, then the thread ends."""
        self.stop.set()
        self.sock.close(linger=0)
        self.monitor.thread.join(5)
        assert not self.monitor.thread.is_alive()
        self.ctx.term()

    def close_with(self, server) -> None:
        """Close, stopping the CURVE authenticator before the context is terminated."""
        self.stop.set()
        self.sock.close(linger=0)
        self.monitor.thread.join(5)
        assert server.close() == []
        self.ctx.term()


@pytest.fixture
def bound():
    b = Bound()
    yield b
    b.close()


def _events_reach(ledger: Ledger, **counts: int) -> bool:
    def reached() -> bool:
        events = ledger.peer_events()
        return all(events.get(k, 0) >= n for k, n in counts.items())

    return wait_for(reached, 10)


def test_counts_connections_and_disconnections(bound):
    assert bound.monitor.thread.name == THREAD_NAME
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{bound.port}")
    assert _events_reach(bound.ledger, accepted=1, handshake_succeeded=1)
    push.close(linger=0)
    ctx.term()
    assert _events_reach(bound.ledger, disconnected=1)
    assert bound.ledger.peer_events() == {
        "accepted": 1,
        "handshake_succeeded": 1,
        "disconnected": 1,
    }
    assert bound.failures == []


def test_events_after_stop_are_not_booked_and_the_socket_keeps_working(bound):
    bound.stop.set()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{bound.port}")
    push.send(b"x")
    # The monitor is still read (libzmq would stall the socket otherwise), but books nothing.
    assert bound.sock.poll(5000)
    assert bound.ledger.peer_events() == {}
    assert bound.monitor.thread.is_alive()
    push.close(linger=0)
    ctx.term()


def test_refusals_are_counted_each_and_logged_once(tmp_path, caplog):
    from stagefeed.common import curve

    keys = str(tmp_path / "keys")
    write_keys(keys, 0)
    server = curve.server_configurator(keys)
    bound = Bound(configure=server)
    ctx = zmq.Context()
    plain = [ctx.socket(zmq.PUSH) for _ in range(3)]
    failed = ("handshake_failed_protocol", "handshake_failed_no_detail")
    try:
        with caplog.at_level(logging.WARNING, logger="stagefeed.consumer.intake.socket_events"):
            for sock in plain:  # libzmq does not retry a refused handshake: three peers
                sock.connect(f"tcp://127.0.0.1:{bound.port}")

            def refused_three_times() -> bool:
                events = bound.ledger.peer_events()
                return sum(events.get(k, 0) for k in failed) >= 3

            assert wait_for(refused_three_times, 10), bound.ledger.peer_events()
        refusals = [r for r in caplog.records if "refused a peer" in r.getMessage()]
        kinds = {k for k in failed if bound.ledger.peer_events().get(k)}
        assert len(refusals) == len(kinds)  # once per kind within the interval
    finally:
        for sock in plain:
            sock.close(linger=0)
        ctx.term()
        bound.close_with(server)


def test_abandon_lets_the_context_terminate():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    monitor = PeerMonitor(sock, Ledger(), threading.Event(), lambda exc: None)
    sock.close(linger=0)
    monitor.abandon()
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive()
    assert os.getpid()  # the process is still ours: nothing hung
