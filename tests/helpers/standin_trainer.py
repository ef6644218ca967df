"""A trainer stand-in for producer tests: a real ROUTER socket in a thread, speaking protocol v2.

Not a mock: it binds a real TCP port, decodes what producers send with ``common.protocol`` and
answers with ``welcome`` / ``refused`` / ``credit`` / ``dropped`` / ``bye`` as a trainer would.
The test steers it (grant credit, pause reading, forget connections, say bye) through
commands its thread executes, so its socket is only ever used by that thread.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from stagefeed.common import protocol
from stagefeed.common.errors import DropReason
from stagefeed.common.schema import Schema
from tests.conftest import free_tcp_port


@dataclasses.dataclass(frozen=True)
class Received:
    identity: bytes
    seq: int
    summary: Any  # what ``inspect(seq, arrays)`` returned
    at: float


def schema_detail(mine: Schema, theirs: Schema) -> str:
    """The line a trainer puts in a spec_mismatch refusal: the first differing array."""
    for (name, dtype, shape), (_, their_dtype, their_shape) in zip(
        mine.wire(), theirs.wire(), strict=False
    ):
        if (dtype, shape) != (their_dtype, their_shape):
            return (
                f"{name}: producer sends {their_dtype.name}{list(their_shape)}, "
                f"trainer expects {dtype.name}{list(shape)}"
            )
    return f"arrays {list(theirs.names)}, trainer expects {list(mine.names)}"


class StandInTrainer:
    """Binds ``endpoint`` (a free loopback port by default) and serves until ``close()``.

    ``credit``: granted in each welcome. ``regrant``: one more credit per batch read (as the
    real trainer re-grants as it consumes). ``drop``: seq -> reason, answered with ``dropped``.
    ``refuse``: (reason, detail) answered to every hello. ``rcvhwm``: the ROUTER's receive
    high-water mark. ``inspect(seq, arrays)``: what to keep of each batch (default: nothing).
    ``ack_end``: answer an ``end`` with ``ended`` when the hello asked for it (``ack_end``).
    """

    def __init__(
        self,
        schema: Schema,
        endpoint: str | None = None,
        *,
        credit: int = 2,
        regrant: bool = False,
        drop: dict[int, str] | None = None,
        refuse: tuple[str, str] | None = None,
        rcvhwm: int = 1000,
        inspect: Callable[[int, dict[str, np.ndarray]], Any] | None = None,
        read_delay_s: float = 0.0,
        ack_end: bool = True,
    ) -> None:
        self.schema = schema
        self.endpoint = endpoint or f"tcp://127.0.0.1:{free_tcp_port()}"
        self.credit = credit
        self.regrant = regrant
        self.drop = drop or {}
        self.refuse = refuse
        self.rcvhwm = rcvhwm
        self.inspect = inspect or (lambda seq, arrays: None)
        self.read_delay_s = read_delay_s
        self.ack_end = ack_end
        self._acks: set[bytes] = set()  # connections whose hello said ``ack_end``
        self.hellos: list[tuple[bytes, dict[str, Any]]] = []
        self.received: list[Received] = []
        self.pings: list[tuple[bytes, float]] = []
        self.ends: list[tuple[bytes, int]] = []
        self.byes: list[dict[str, Any]] = []  # every ``end`` header whole (reason, detail)
        self.reading = threading.Event()
        self.reading.set()
        self._known: set[bytes] = set()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._bound = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standin-trainer", daemon=True)
        self.bind_error: Exception | None = None
        self._thread.start()
        assert self._bound.wait(15), f"stand-in trainer did not bind: {self.bind_error}"

    # -- steering (any thread) ---------------------------------------------------------------

    def grant(self, n: int, identity: bytes | None = None) -> None:
        self._commands.put(("credit", n, identity))

    def bye(self) -> None:
        self._commands.put(("bye", 0, None))

    def forget(self) -> None:
        """Forget every connection, as a trainer does with producers silent for ~10 s."""
        self._commands.put(("forget", 0, None))

    def seqs(self) -> list[int]:
        return [r.seq for r in self.received]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def __enter__(self) -> StandInTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.LINGER, 0)
        # A restarted stand-in binds the port its predecessor just closed: ZeroMQ closes a
        # socket in its I/O thread, so the port may be busy a moment longer (on a loaded host).
        deadline = time.monotonic() + 10
        while True:
            try:
                sock.bind(self.endpoint)
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    self.bind_error = exc
                    sock.close(linger=0)
                    raise
                time.sleep(0.05)
        self._bound.set()
        try:
            while not self._stop.is_set():
                self._run_commands(sock)
                if not self.reading.is_set():
                    time.sleep(0.01)
                    continue
                if sock.poll(20, zmq.POLLIN):
                    self._serve(sock, sock.recv_multipart(copy=False))
        finally:
            sock.close(linger=0)

    def _run_commands(self, sock: zmq.Socket) -> None:
        while True:
            try:
                kind, n, identity = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "credit":
                for peer in [identity] if identity else sorted(self._known):
                    self._send(sock, peer, "credit", n=n)
            elif kind == "bye":
                for peer in sorted(self._known):
                    self._send(sock, peer, "bye")
            elif kind == "forget":
                self._known.clear()

    def _send(self, sock: zmq.Socket, identity: bytes, kind: str, **fields: Any) -> None:
        sock.send_multipart([identity, protocol.encode_control(kind, **fields)])

    def _serve(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        header = protocol.decode_header(frames[1].buffer, protocol.FROM_PRODUCER)
        kind = header["t"]
        if kind == "hello":
            self.hellos.append((identity, header))
            if header.get("ack_end") is True:
                self._acks.add(identity)
            declared = protocol.schema_of_hello(header)
            if self.refuse is not None:
                self._send(sock, identity, "refused", reason=self.refuse[0], detail=self.refuse[1])
            elif declared is not None and declared.wire() != self.schema.wire():
                detail = schema_detail(self.schema, declared)
                self._send(sock, identity, "refused", reason="spec_mismatch", detail=detail)
            else:
                self._known.add(identity)
                self._send(
                    sock,
                    identity,
                    "welcome",
                    schema=self.schema.to_dict(),
                    max_message=self.schema.batch_bytes + 2**20,
                    credit=self.credit,
                )
        elif kind == "batch":
            self._batch(sock, identity, header, frames)
        elif kind == "ping":
            self.pings.append((identity, time.monotonic()))
            if identity not in self._known:
                self._send(sock, identity, "refused", reason="no_hello", detail="who are you?")
        elif kind == "end":
            self.byes.append(header)
            self.ends.append((identity, header["seq"]))
            if self.ack_end and identity in self._acks:
                self._send(sock, identity, "ended", seq=header["seq"])

    def _batch(self, sock, identity, header, frames) -> None:
        seq = header["seq"]
        if identity not in self._known:
            self._send(sock, identity, "dropped", seq=seq, reason="no_hello", detail="no hello")
            return
        batch = protocol.decode_batch(header, [f.buffer for f in frames[1:]])
        protocol.check_against_schema(batch, self.schema)
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        if seq in self.drop:
            reason = DropReason(self.drop[seq])
            self._send(sock, identity, "dropped", seq=seq, reason=reason, detail=f"test {reason}")
        else:
            summary = self.inspect(seq, batch.arrays)
            self.received.append(Received(identity, seq, summary, time.monotonic()))
        if self.regrant:
            self._send(sock, identity, "credit", n=1)
