"""Connections that go quiet are noticed (``common.liveness``): heartbeats and TCP keepalive on
both ends; a frozen trainer is reported lost by its endpoint and the others keep training."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import zmq

from stagefeed.common import liveness
from stagefeed.common.errors import ClosedError
from tests.conftest import REPO, free_tcp_port, wait_for
from tests.helpers.standin_trainer import StandInTrainer
from tests.test_fanout import SMALL, number, options
from tests.test_producer_worker import Running


@pytest.mark.parametrize(
    ("message_mib", "timeout_s"), [(1, 10.0), (50, 10.0), (151, 30.2), (1024, 204.8)]
)
def test_the_timeout_covers_twice_a_messages_send_time_at_the_floor_speed(message_mib, timeout_s):
    assert liveness.heartbeat_timeout_s(message_mib * liveness.MIB) == pytest.approx(timeout_s)


def test_configure_sets_heartbeats_and_keepalive():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        liveness.configure(sock, 30.2)
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 2000
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 30200
        assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
        assert sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == liveness.KEEPALIVE_IDLE_S
        assert sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL) == liveness.KEEPALIVE_INTVL_S
        liveness.configure(sock, 1.0)  # a short timeout pings twice in it
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 500
    finally:
        sock.close(linger=0)
        ctx.term()


STANDIN = textwrap.dedent(
    """
    import sys, time
    from tests.helpers.standin_trainer import StandInTrainer
    from tests.test_fanout import SMALL, number
    StandInTrainer(SMALL, sys.argv[1], regrant=True, inspect=number)
    print("bound", flush=True)
    time.sleep(600)
    """
)


def test_a_frozen_trainer_is_reported_lost_by_endpoint_and_the_other_keeps_training(caplog):
    """SIGSTOP freezes trainer ``a`` with its connections open (no FIN, no RST, as a host that
    dies or a partition): the producer's heartbeats time out, it logs ``a`` lost by endpoint
    and feeds ``b`` alone."""
    caplog.set_level(logging.INFO, logger="stagefeed.producer")
    frozen = f"tcp://127.0.0.1:{free_tcp_port()}"
    a = subprocess.Popen(
        [sys.executable, "-c", STANDIN, frozen], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    try:
        assert a.stdout is not None and a.stdout.readline().strip() == "bound"
        with StandInTrainer(SMALL, regrant=True, inspect=number) as b:
            running = Running(options(frozen, b, rate=200.0, heartbeat_timeout_s=1.0))
            assert wait_for(lambda: len(b.received) >= 5, 10)
            os.kill(a.pid, signal.SIGSTOP)
            lost = f"lost the trainer at {frozen} (connection closed, or silent past the heartbeat"
            assert wait_for(lambda: any(lost in r.getMessage() for r in caplog.records), 15)
            before = len(b.received)
            assert wait_for(lambda: len(b.received) >= before + 50, 10)  # b alone, still fed
            running.stop.set()
            with pytest.raises(ClosedError):
                running.join()
    finally:
        a.kill()
        a.wait(10)
