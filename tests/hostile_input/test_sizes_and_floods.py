"""Sizes and floods: a message of 200k empty frames, 20,000 junk messages, messages over
``--max-message-mb`` (a raw ZMTP frame header declaring 1 TiB, a real 64 MiB frame, many
frames each under the limit), and a batch in flight when the intake stops. What one message
may cost is ``per_message_mib`` (the package's docstring says what it counts).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import zmq
import zmq.utils.monitor

from tests.helpers import procs
from tests.hostile import wire
from tests.hostile.peers import RawZmtpPeer, read_reply
from tests.hostile_input.harness import (
    MAX_MESSAGE_MB,
    PEERS,
    WAIT_S,
    Case,
    H,
    W,
    check_cases,
    check_peak,
    check_still_training,
    delta,
    heap_in_use_floor_mib,
    new_peer,
    one,
    require,
)

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

ZMQ_MSG_BYTES = 64  # sizeof(zmq_msg_t): what libzmq holds per received frame


def frames_mib(frames: int) -> float:
    """What libzmq holds for a message of ``frames`` frames until its last one is in: a
    ``zmq_msg_t`` each (small frames need no more), in the pipe's chunks of 256."""
    return frames * ZMQ_MSG_BYTES / procs.MIB


def per_message_mib(frames: int) -> float:
    """What one message may cost the trainer: ``--max-message-mb`` + libzmq's per-frame cost."""
    return MAX_MESSAGE_MB + frames_mib(frames)


def test_message_of_200k_empty_frames(target, peer):
    """v1: 200k empty frames (0.38 MiB on the wire) raised the trainer's RSS by 72 MiB and kept
    the proxy busy 2.5 s. Now: dropped as ``parts`` (the frame reader keeps at most its limit
    of frames: test_intake.py), training goes on, and the trainer holds nothing of it after:
    the heap in use between steps is back where it was.

    While it arrives the message costs 12.2 MiB (``frames_mib``): libzmq buffers all of a
    multipart message before the intake sees a frame, in pipe chunks that the I/O thread
    serving the connection allocates from its malloc arena; the intake frees them as it
    reads, and malloc keeps them (trimming is off). Measured on fresh trainers: one arena grew
    by 12.3 MiB, the heap's freed bytes by as much; a second such message cost 1.6-1.7 MiB more
    twice, and 14.1 MiB once, in another mapping (the other of the 2 I/O threads, it seems).
    In 14 runs of this package RSS rose by 9.9-14.3 MiB, 9.8 MiB of it in one arena each
    time. So what RSS does depends on which I/O thread takes the message and what its arena
    had free: on the allocator's history, not on the code under test. That rise was
    this test's bound (19.2 MiB, a non-strict xfail: over it in 2 of 5 fresh-clone runs); the
    package's RSS budget bounds it instead (``check_peak``).
    """
    frames = 200_000
    floor = heap_in_use_floor_mib(target)
    check_cases(target, [one("200k", [H()] + [b""] * frames, "parts")], peer)
    after = heap_in_use_floor_mib(target)
    # Anything of the message still held would hold its chunks too: 12.2 MiB.
    assert after - floor < frames_mib(frames) / 2, (
        f"heap in use between steps {after:.1f} MiB after the message, {floor:.1f} before; "
        f"its pipe chunks were {frames_mib(frames):.1f} MiB"
    )


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
    check_peak(target)


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
    reason="--max-message-mb becomes libzmq's ZMQ_MAXMSGSIZE (consumer/intake/intake.py "
    "Intake.start), "
    "a limit per *frame*: libzmq buffers a whole multipart message before the intake sees its "
    "first frame, so frames of 3 MiB - 16 B all sit in the trainer (here more of them than its "
    "whole RSS) before it drops them as parts; TrainerOptions says max_message_mb caps each "
    "message",
)
def test_message_of_many_frames_each_under_max_message_mb(target, peer):
    """Last but the summary: the trainer keeps (glibc, one arena, trim off) what libzmq
    allocated. The message is larger than the trainer's whole RSS plus 256 MiB: memory the
    trainer freed earlier and kept is reused first, and can hide no more than that RSS. The
    bound, were --max-message-mb a cap per message: one message's cost plus what malloc may
    keep freed (``procs.allocator_allowance_mib``)."""
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
    allowance = procs.allocator_allowance_mib(PEERS, MAX_MESSAGE_MB)
    assert peak - steady <= per_message_mib(len(frames)) + allowance, (
        f"peak RSS {peak - steady:.1f} MiB above the steady peak for one message"
    )
