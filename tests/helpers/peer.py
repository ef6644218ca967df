"""A minimal protocol-v2 producer for tests: a real DEALER socket speaking ``common.protocol``.

Used where a test must control exactly what goes on the wire (sequence numbers, cuts); the
real producer (``stagefeed produce``) is used everywhere else.
"""

from __future__ import annotations

import secrets
import time

import numpy as np
import zmq

from stagefeed.common import protocol

IMAGES = np.zeros((2, 227, 227, 3), np.float32)
LABELS = np.array([0, 1], np.int32)


class Peer:
    def __init__(self, ctx: zmq.Context, endpoint: str, name: str, timeout_s: float = 60,
                 monitor_events: int = 0) -> None:  # fmt: skip
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A monitor of ``monitor_events`` sees the first connection's events only if it is
        # attached before ``connect``: a handshake can complete before the next line runs.
        self.monitor = self.sock.get_monitor_socket(monitor_events) if monitor_events else None
        self.sock.connect(endpoint)
        self.name, self.timeout_s, self.credit = name, timeout_s, 0
        # As a real producer: one secret token for this peer's run, in every hello; the
        # trainer links the books of its connections by it (a cut shows as seq_missing).
        self.session = secrets.token_hex(16)
        self.replies: list[dict] = []

    def hello(self) -> dict:
        self.sock.send(
            protocol.encode_control("hello", name=self.name, schema=None, session=self.session)
        )
        while True:
            reply = self.read()
            if reply["t"] == "welcome":
                # Credit counts from the welcome on: grants read before it were the previous
                # connection's (still queued in this socket when a cut reconnected it).
                self.credit = reply.get("credit", 0)
                return reply
            if reply["t"] == "refused":
                return reply

    def read(self) -> dict:
        assert self.sock.poll(int(self.timeout_s * 1000)), "no reply from the trainer"
        reply = protocol.decode_header(self.sock.recv(), protocol.FROM_TRAINER)
        self.replies.append(reply)
        self.credit += reply.get("credit", 0) + reply.get("n", 0)
        return reply

    def send_batch(self, seq: int, frames: list | None = None) -> None:
        """One batch against credit (waiting for it); ``frames`` replaces the real encoding."""
        deadline = time.monotonic() + self.timeout_s
        while self.credit == 0:
            assert time.monotonic() < deadline, "no credit from the trainer"
            self.read()
        self.credit -= 1
        self.sock.send_multipart(
            frames or protocol.encode_batch(seq, [("images", IMAGES), ("labels", LABELS)])
        )

    def close(self) -> None:
        self.sock.close(linger=0)
