"""The peers a test drives itself, both real connections to the trainer.

- ``Peer``: a DEALER that speaks v2 from the test: hello, credit accounting, verdicts.
- ``RawZmtpPeer``: ZMTP 3.0 with a plain TCP socket, Socket-Type DEALER, so it can declare a
  frame of any size without having the bytes.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from tests.hostile.wire import V, hello

# -- a v2 peer in the test process ------------------------------------------------------------


def read_reply(raw: bytes) -> dict[str, Any]:
    """A trainer message, read with plain msgpack (independently of the product's decoder)."""
    reply = msgpack.unpackb(raw, raw=False)
    if not isinstance(reply, dict) or reply.get("v") != V:
        raise ValueError(f"not a v{V} message from the trainer: {reply!r:.200}")
    return reply


class Peer:
    """One DEALER connection to the trainer, used from one thread.

    ``credit`` is what the trainer granted (welcome, credit) minus the batches sent with
    ``send_batch``; ``verdicts`` are the ``dropped`` replies, ``refusals`` the ``refused`` ones,
    in arrival order. ``pump`` reads whatever the trainer sent.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        configure: Callable[[zmq.Socket], None] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.setsockopt(zmq.SNDHWM, 100_000)  # floods queue here, not block
        if configure is not None:
            configure(self.sock)
        self.sock.connect(endpoint)
        self.name: str | None = None
        self.credit = 0
        self.welcome: dict[str, Any] | None = None
        self.verdicts: list[dict[str, Any]] = []
        self.refusals: list[dict[str, Any]] = []
        self.replies: list[dict[str, Any]] = []
        self.last_sent = time.monotonic()

    def send(self, frames: Sequence[Any], copy: bool = True) -> None:
        self.sock.send_multipart(list(frames), copy=copy)
        self.last_sent = time.monotonic()

    def pump(self, timeout_s: float = 0.0) -> int:
        """Read the trainer's messages, waiting up to ``timeout_s`` for the first; the count."""
        count = 0
        wait_ms = int(timeout_s * 1000)
        while self.sock.poll(wait_ms):
            wait_ms = 0
            frames = self.sock.recv_multipart()
            reply = read_reply(frames[0])
            self.replies.append(reply)
            kind = reply["t"]
            if kind == "welcome":
                self.welcome = reply
                self.credit += reply["credit"]
            elif kind == "credit":
                self.credit += reply["n"]
            elif kind == "dropped":
                self.verdicts.append(reply)
            elif kind == "refused":
                self.refusals.append(reply)
            count += 1
        return count

    def wait(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(left, 0.2))
        return True

    def hello(self, name: str, schema: dict | None = None) -> dict[str, Any]:
        """Say hello; the welcome or refused reply."""
        seen = len(self.refusals)
        self.name = name
        self.send(hello(name, schema))
        if not self.wait(lambda: self.welcome is not None or len(self.refusals) > seen):
            raise TimeoutError(f"no welcome nor refused for hello {name!r} from {self.endpoint}")
        return self.welcome if self.welcome is not None else self.refusals[-1]

    def take_credit(self) -> None:
        if not self.wait(lambda: self.credit > 0):
            raise TimeoutError(f"{self.endpoint} granted {self.name!r} no credit")
        self.credit -= 1

    def send_batch(self, frames: Sequence[Any], copy: bool = True) -> None:
        """Send a batch-kind message against one credit (waiting for it)."""
        self.take_credit()
        self.send(frames, copy=copy)

    def verdict_for(self, seq: int, count: int = 1) -> list[dict[str, Any]]:
        """Wait for ``count`` verdicts on ``seq``; those seen."""
        self.wait(lambda: len([v for v in self.verdicts if v["seq"] == seq]) >= count)
        return [v for v in self.verdicts if v["seq"] == seq]

    def close(self) -> None:
        self.sock.close(linger=0)


# -- a raw ZMTP peer ---------------------------------------------------------------------------


class RawZmtpPeer:
    """A ZMTP 3.0 DEALER peer written with a plain TCP socket (NULL security, RFC 23/ZMTP).

    It can declare a frame of any size without having the bytes, which is how a message over
    ``--max-message-mb`` is sent without allocating it on this side either.
    """

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
        self.sock.sendall(greeting + b"\x00" + bytes(31))
        self._read_exactly(64)
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        self.sock.sendall(bytes([0x04, len(ready)]) + ready)
        flags, size = self._read_exactly(2)
        assert flags == 0x04, f"expected a READY command, got flags {flags:#x}"
        body = self._read_exactly(size)
        assert b"Socket-Type" in body and b"ROUTER" in body, body

    def send_message(self, frames: list) -> None:
        for i, frame in enumerate(frames):
            self.send_frame_header(len(memoryview(frame).cast("B")), more=i < len(frames) - 1)
            self.sock.sendall(frame)

    def send_frame_header(self, size: int, more: bool = False) -> None:
        flags = 0x01 if more else 0x00
        if size < 256:
            self.sock.sendall(bytes([flags, size]))
        else:
            self.sock.sendall(bytes([flags | 0x02]) + struct.pack(">Q", size))

    def recv_message(self) -> list[bytes]:
        """The next message from the trainer (commands skipped)."""
        frames: list[bytes] = []
        while True:
            flags = self._read_exactly(1)[0]
            size_bytes = 8 if flags & 0x02 else 1
            size = int.from_bytes(self._read_exactly(size_bytes), "big")
            body = self._read_exactly(size)
            if flags & 0x04:
                continue
            frames.append(body)
            if not flags & 0x01:
                return frames

    def closed_by_peer(self) -> bool:
        """Block until the trainer closes the connection (EOF or reset); True if it did."""
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()

    def _read_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("peer closed during the ZMTP exchange")
            data += chunk
        return data
