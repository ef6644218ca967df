"""Messages a hostile or broken peer could send the trainer (wire protocol v2), and the peers.

Builders return the frames of one ZeroMQ multipart message as a DEALER sends it (the trainer's
ROUTER adds the routing id). ``good_frames`` is the real encoder's output
(``common.protocol.encode_batch``); the others bend one thing at a time.

Peers, all real ZeroMQ connections:

- ``Peer``: a DEALER that speaks v2 from the test: hello, credit accounting, verdicts.
- ``GoodPeer`` (``python -m tests.hostile good-peer``): a v2 good producer in its own process.
  It says hello, adopts the trainer's schema and sends valid batches against credit at a
  rate, pinging while idle. The hostile tests use it until the real ``stagefeed produce``
  speaks v2 (``good_producer_args`` picks).
- ``RawZmtpPeer``: ZMTP 3.0 with a plain TCP socket, Socket-Type DEALER, so it can declare a
  frame of any size without having the bytes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
import zmq
from stagefeed.common import protocol
from stagefeed.common.schema import Schema

IMAGE_SHAPE = [2, 227, 227, 3]
NUM_CLASSES = 1000
V = protocol.PROTOCOL_VERSION
REPO = pathlib.Path(__file__).resolve().parent.parent
_rng = random.Random(4)


# -- message builders --------------------------------------------------------------------------


def images(shape=IMAGE_SHAPE, dtype=np.float32) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def labels(values=(0, 1)) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def good_frames(seq: int) -> list[bytes]:
    """A valid batch of the tests' trainer schema (float32 images 2x227x227x3, int32 labels)."""
    frames = protocol.encode_batch(seq, [("images", images()), ("labels", labels())])
    return [bytes(f) for f in frames]


def control(kind: str, **fields: Any) -> list[bytes]:
    """A well-formed control message (hello, end, ping) from the real encoder."""
    return [protocol.encode_control(kind, **fields)]


def hello(name: str, schema: dict | None = None) -> list[bytes]:
    return control("hello", name=name, schema=schema)


def packed_map(fields: dict[str, Any], raw: dict[str, bytes] | None = None) -> bytes:
    """A msgpack map of ``fields``, plus ``raw`` values given as already-packed bytes (to nest
    deeper than msgpack's packer allows)."""
    raw = raw or {}
    count = len(fields) + len(raw)
    assert count < 16
    out = bytes([0x80 | count])
    for key, value in fields.items():
        out += msgpack.packb(key) + msgpack.packb(value)
    for key, value in raw.items():
        out += msgpack.packb(key) + value
    return out


def header(**fields: Any) -> bytes:
    """A valid batch header, with ``fields`` replaced (a value of ``...`` removes the field)."""
    h = {
        "v": V,
        "t": "batch",
        "seq": 0,
        "arrays": [["images", "<f4", IMAGE_SHAPE], ["labels", "<i4", [2]]],
    }
    h.update(fields)
    return msgpack.packb({k: v for k, v in h.items() if v is not ...})


def with_header(head: bytes, image_bytes: bytes | None = None, label_bytes: bytes | None = None):
    image_bytes = images().tobytes() if image_bytes is None else image_bytes
    label_bytes = labels().tobytes() if label_bytes is None else label_bytes
    return [head, image_bytes, label_bytes]


def garbage(size: int) -> bytes:
    # 0xc1 is the one byte msgpack never uses: the header cannot decode by accident.
    return b"\xc1" + bytes(_rng.getrandbits(8) for _ in range(size - 1))


def images_declared(dtype: str, shape=IMAGE_SHAPE, frame: bytes | None = None) -> list:
    """Images declared with ``dtype``/``shape``; the frame holds as many bytes as declared."""
    if frame is None:
        itemsize = np.dtype(dtype).itemsize if dtype != "|O" else 8
        frame = bytes(itemsize * int(np.prod(shape)))
    arrays = [["images", dtype, shape], ["labels", "<i4", [2]]]
    return with_header(header(arrays=arrays), frame)


def nested_lists(depth: int) -> bytes:
    """msgpack bytes of ``depth`` lists, each the only element of the one around it."""
    return b"\x91" * (depth - 1) + b"\x90"


def nested_maps(depth: int) -> bytes:
    """msgpack bytes of ``depth`` maps ``{"a": {"a": ... {}}}``."""
    return (b"\x81" + msgpack.packb("a")) * (depth - 1) + b"\x80"


class FileCreator:
    """Unpickling this calls ``open(path, "w")``: a pickle that leaves evidence if ever run."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def msgpack_numpy_payload(marker: pathlib.Path) -> bytes:
    """msgpack-numpy's encoding of an object array; its decoder would unpickle the element."""
    array = np.empty(1, dtype=object)
    array[0] = FileCreator(marker)
    return msgpack_numpy.packb(array)


def msgpack_numpy_decodes(payload: bytes):
    """What msgpack-numpy's own decoder does with it (the positive control, test side only)."""
    return msgpack_numpy.unpackb(payload)


def valid_arrays(schema: Schema) -> list[tuple[str, np.ndarray]]:
    """One valid batch of ``schema``: zeros, or values cycling through an array's bounds."""
    out = []
    for spec in schema.arrays:
        shape = schema.batch_shape(spec)
        if spec.bounds is None:
            array = np.zeros(shape, dtype=spec.np_dtype)
        else:
            low, high = spec.bounds
            count = int(np.prod(shape))
            array = (np.arange(count) % (high - low) + low).astype(spec.np_dtype).reshape(shape)
        out.append((spec.name, np.ascontiguousarray(array)))
    return out


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


# -- the good producer until ``stagefeed produce`` speaks v2 ----------------------------------


class GoodPeer:
    """A v2 producer: hello (adopting the trainer's schema), valid batches against credit at
    ``rate`` per second, a ping after a second idle, hello again if refused ``no_hello``.
    """

    def __init__(self, connect: str, name: str, rate: float, configure=None) -> None:
        self.connect, self.name, self.rate = connect, name, rate
        self.configure = configure
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> int:
        ctx = zmq.Context()
        peer = Peer(ctx, self.connect, self.configure)
        try:
            reply = peer.hello(self.name)
            if reply["t"] != "welcome":
                raise SystemExit(f"good-peer {self.name}: {reply}")
            schema = Schema.from_dict(reply["schema"], source="welcome")
            arrays = valid_arrays(schema)
            print(f"good-peer {self.name}: welcome, {schema.describe()}", flush=True)
            interval = 1.0 / self.rate if self.rate else 0.0
            next_at = time.monotonic()
            refused = 0
            while not self.stop.is_set():
                peer.pump(0.02)
                if len(peer.refusals) > refused:
                    refused = len(peer.refusals)
                    print(f"good-peer {self.name}: refused {peer.refusals[-1]}", flush=True)
                    peer.welcome = None
                    peer.hello(self.name)
                now = time.monotonic()
                if peer.credit > 0 and now >= next_at:
                    peer.credit -= 1
                    peer.send(protocol.encode_batch(self.sent, arrays), copy=False)
                    self.sent += 1
                    next_at = max(next_at + interval, now - interval)
                elif now - peer.last_sent > 1.0:
                    peer.send(control("ping"))
            peer.send(control("end", seq=self.sent))
            print(f"good-peer {self.name}: stopped after {self.sent} batches", flush=True)
            return 0
        finally:
            peer.sock.close(linger=2000)
            ctx.term()


def _good_peer_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hostile good-peer")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--name", default="good-peer")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--curve-keys", default=None)
    args = parser.parse_args(argv)
    configure = None
    if args.curve_keys:
        from stagefeed.common.curve import client_configurator

        configure = client_configurator(args.curve_keys)
    peer = GoodPeer(args.connect, args.name, args.rate, configure)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: peer.stop.set())
    return peer.run()


def cli_producer_speaks_v2() -> bool:
    """Whether ``stagefeed produce`` is the v2 rewrite (it says hello) rather than v1.

    ``STAGEFEED_TEST_GOOD_PRODUCER=cli`` or ``=peer`` overrides the guess.
    """
    forced = os.environ.get("STAGEFEED_TEST_GOOD_PRODUCER")
    if forced in ("cli", "peer"):
        return forced == "cli"
    text = "".join(p.read_text(errors="replace") for p in (REPO / "producer").glob("*.py"))
    return "encode_control(" in text and "hello" in text and "protocol.encode(" not in text


class PeerProcess:
    """``python -m tests.hostile good-peer ...`` in its own process group; quacks like
    ``tests.conftest.Started`` so a ``procs.Spawner`` stops it with the rest."""

    def __init__(self, args: Sequence[str], log_path, env: dict[str, str]) -> None:
        import subprocess

        self.log_path = log_path
        self._log = open(log_path, "w+")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile", "good-peer", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            start_new_session=True,
        )

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


def start_good_producer(spawn, endpoint: str, rate: str, *, name: str = "good",
                        curve_keys: str | None = None, tiny: Sequence[str] = ()):
    """The good producer: the real ``stagefeed produce`` once it speaks v2, else a GoodPeer.

    ``spawn`` is a ``tests.procs.Spawner``; the process is stopped by its ``kill_all``.
    """
    keys = ["--curve-keys", curve_keys] if curve_keys else []
    if cli_producer_speaks_v2():
        return spawn(["produce", "--connect", endpoint, *tiny, "--rate", rate, *keys], name=name)
    from tests.conftest import cli_env

    log_path = spawn.folder / f"{name}-{len(spawn.started)}.log"
    proc = PeerProcess(
        ["--connect", endpoint, "--name", name, "--rate", rate, *keys], log_path, cli_env()
    )
    spawn.started.append(proc)
    return proc


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


# -- a batch in flight when the intake closes ----------------------------------------------


def stop_with_batch_in_flight() -> int:
    """``python -m tests.hostile stop-in-flight``: an in-process intake whose enqueue returns
    only after ``close()`` was called (as a FIFOQueue enqueue cancelled at shutdown does).
    Prints how long ``close()`` took; exits 0 if the process survived it.
    """
    from stagefeed.common.ledger import Ledger
    from stagefeed.common.options import TrainerOptions
    from stagefeed.common.schema import ArraySpec
    from stagefeed.consumer.intake import Intake

    schema = Schema((ArraySpec("x", "float32", (3,)),), 2)
    entered, closing = threading.Event(), threading.Event()

    def enqueue(arrays, index, seq) -> bool:
        entered.set()
        closing.wait(5)
        time.sleep(0.3)  # the intake thread has seen the stop flag by now
        return False  # "closed for shutdown"

    options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=schema, queue_mb=1)
    intake = Intake(options, schema, enqueue, Ledger()).start()
    ctx = zmq.Context()
    peer = Peer(ctx, intake.endpoint, timeout_s=10)
    peer.hello("in-flight")
    peer.send_batch(protocol.encode_batch(0, valid_arrays(schema)))
    if not entered.wait(10):
        return 2
    began = time.monotonic()
    threading.Timer(0.05, closing.set).start()
    intake.close()
    print(f"closed in {time.monotonic() - began:.2f} s", flush=True)
    peer.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["stop-in-flight"]:
        sys.exit(stop_with_batch_in_flight())
    if sys.argv[1:2] != ["good-peer"]:
        sys.exit("usage: python -m tests.hostile good-peer --connect ENDPOINT [--name N]")
    sys.exit(_good_peer_main(sys.argv[2:]))
