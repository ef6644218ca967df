"""Sizes and floods: a message of 200k empty frames, 20,000 junk messages, messages over
``--max-message-mb`` (a raw ZMTP frame header declaring 1 TiB, a real 64 MiB frame, many
frames each under the limit), and a batch in flight when the intake stops. The memory bound
per message is ``per_message_mib`` (the package's docstring says what it counts).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import zmq
import zmq.utils.monitor

from tests import procs
from tests.hostile import wire
from tests.hostile.peers import RawZmtpPeer, read_reply
from tests.hostile_input.harness import (
    MAX_MESSAGE_MB,
    WAIT_S,
    Case,
    H,
    W,
    check_cases,
    check_peak,
    check_still_training,
    delta,
    new_peer,
    one,
    require,
)

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

ZMQ_MSG_BYTES = 64  # sizeof(zmq_msg_t): what libzmq holds per received frame
NOISE_MIB = 4  # RSS moves this much with the good producer's batches alone


def per_message_mib(frames: int) -> float:
    """What one message may cost the trainer: ``--max-message-mb`` + libzmq's per-frame cost."""
    return MAX_MESSAGE_MB + frames * ZMQ_MSG_BYTES / procs.MIB


@pytest.mark.xfail(
    strict=False,
    raises=AssertionError,
    reason="open: since the module became a package (2026-12-01) the rise went over its bound in "
    "2 of 5 fresh-clone runs (27.9 and 32.5 MiB against 19.2; within it in the others and in "
    "every local run); cause not found (suspected: the trainer's heap history, which the "
    "package's test order changed)",
)
def test_message_of_200k_empty_frames(target, peer):
    """v1: 200k empty frames (0.38 MiB on the wire) raised the trainer's RSS by 72 MiB and kept
    the proxy busy 2.5 s. Now: dropped as ``parts``; the trainer's peak RSS rises by at most one
    message's bound above its steady peak: ``--max-message-mb`` + 64 B per frame (15.2 MiB
    here) + 4 MiB of noise."""
    frames = 200_000
    bound = per_message_mib(frames) + NOISE_MIB
    check_cases(target, [one("200k", [H()] + [b""] * frames, "parts")], peer, rise_mib=bound)


def test_flood_of_small_junk(target, peer):
    flood = 20_000
    check_cases(target, [Case("junk", [[b"junk"]] * flood, {"header_not_msgpack": flood})], peer)


# -- messages over --max-message-mb (cut by libzmq, counted as connection events) --------------


def test_message_over_max_message_mb_declared_raw(target):
    """A frame header declaring 1 TiB: libzmq refuses it from the header and cuts the peer."""
    raw = RawZmtpPeer(target.trainer.port)
    try:
        # Control: hello and a valid batch over the same hand-made connection are booked.
        raw.send_message(wire.hello("zmtp-control"))
        reply = read_reply(raw.recv_message()[0])
        assert reply["t"] == "welcome", reply
        credit = reply["credit"]
        while credit < 1:  # the pool may be in other hands for a moment
            reply = read_reply(raw.recv_message()[0])
            credit += reply["n"] if reply["t"] == "credit" else 0
        raw.send_message(wire.good_frames(0))
        control = target.wait(lambda m: m.received.get("zmtp-control", 0) == 1)
        assert control.received["zmtp-control"] == 1
        raw.send_message(wire.control("end", seq=1))  # its credit back before the cut
        raw.send_frame_header(2**40)
        assert raw.closed_by_peer(), "the trainer kept a peer that declared a 1 TiB message"
    finally:
        raw.close()
    target.cut_peers += 1
    after = target.metrics()
    assert delta(after.dropped, control.dropped) == {}  # cut, not counted as a message
    check_still_training(target, after)


def test_message_over_max_message_mb_real(target):
    """A real 64 MiB frame from pyzmq: rejected before the trainer allocates it."""
    p = new_peer(target, "big-control")
    monitor = p.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        p.send_batch(wire.good_frames(0))
        before = target.wait(lambda m: m.received.get("big-control", 0) == 1)
        target.peak.reset()
        p.send(wire.control("end", seq=1))  # its credit back before the cut
        big = np.zeros(64 * procs.MIB, dtype=np.uint8)
        p.send(W(H(seq=1), memoryview(big)), copy=False)  # cut at its frame header
        assert monitor.poll(WAIT_S * 1000), "the trainer did not cut the oversize sender"
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_DISCONNECTED
    finally:
        p.sock.disable_monitor()
        monitor.close(linger=0)
    target.cut_peers += 1
    after = target.metrics()
    assert delta(after.dropped, before.dropped) == {}
    assert after.received["big-control"] == 1
    check_still_training(target, after)
    check_peak(target, target.high_mib)


def test_a_batch_in_flight_at_stop_does_not_hang_the_intake():
    """In a child process (a libzmq abort must not take pytest with it)."""
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env

    done = subprocess.run(
        [sys.executable, "-m", "tests.hostile", "stop-in-flight"], capture_output=True,
        text=True, timeout=60, cwd=REPO, env=cli_env(), check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    require("closed in" in out or done.returncode != 0, out)
    assert done.returncode == 0, out
    assert "did not stop" not in out, out
    closed = float(re.search(r"closed in ([\d.]+) s", out).group(1))
    assert closed < 3.0, out


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="--max-message-mb becomes libzmq's ZMQ_MAXMSGSIZE (consumer/intake.py Intake.start), "
    "a limit per *frame*: libzmq buffers a whole multipart message before the intake sees its "
    "first frame, so frames of 3 MiB - 16 B all sit in the trainer (here more of them than its "
    "whole RSS) before it drops them as parts; TrainerOptions says max_message_mb caps each "
    "message",
)
def test_message_of_many_frames_each_under_max_message_mb(target, peer):
    """Last but the summary: the trainer keeps (glibc, one arena, trim off) what libzmq
    allocated. The message is larger than the trainer's whole RSS plus 256 MiB: memory the
    trainer freed earlier and kept is reused first, and can hide no more than that RSS."""
    steady = target.peak.steady()
    frame = np.zeros(MAX_MESSAGE_MB * procs.MIB - 16, dtype=np.uint8)
    count = math.ceil((steady + 256) / MAX_MESSAGE_MB)
    frames = [H(), *[memoryview(frame)] * count]
    before = target.metrics()
    target.peak.reset()
    peer.send(frames, copy=False)
    after = target.wait(lambda m: delta(m.dropped, before.dropped).get("parts", 0) >= 1)
    target.booked.update(delta(after.dropped, before.dropped))
    require(delta(after.dropped, before.dropped) == {"parts": 1}, "not dropped as parts")
    peak = target.peak.peak_mib(window=True)
    assert peak - steady <= per_message_mib(len(frames)) + NOISE_MIB
