"""Messages a hostile or broken peer could send the trainer, and a raw ZMTP peer.

Every builder returns the frames of one ZeroMQ multipart message. ``good_frames`` is the
real encoder's output (``common.protocol.encode``); the others bend one thing at a time.
"""

from __future__ import annotations

import pathlib
import random
import socket
import struct

import msgpack
import msgpack_numpy
import numpy as np
from stagefeed.common import protocol

IMAGE_SHAPE = [2, 227, 227, 3]
NUM_CLASSES = 1000
_rng = random.Random(4)


def images(shape=IMAGE_SHAPE, dtype=np.float32) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def labels(values=(0, 1)) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def good_frames(producer: str, seq: int) -> list:
    return protocol.encode(producer, seq, [("images", images()), ("labels", labels())])


def header(**fields) -> bytes:
    """A valid header, with ``fields`` replaced (a value of ``...`` removes the field)."""
    h = {
        "v": protocol.PROTOCOL_VERSION,
        "producer": "hostile-test",
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


class RawZmtpPeer:
    """A ZMTP 3.0 PUSH peer written with a plain TCP socket (NULL security, RFC 23/ZMTP).

    It can declare a frame of any size without having the bytes, which is how a message over
    ``--max-message-mb`` is sent without allocating it on this side either.
    """

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
        self.sock.sendall(greeting + b"\x00" + bytes(31))
        self._read_exactly(64)
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
        self.sock.sendall(bytes([0x04, len(ready)]) + ready)
        flags, size = self._read_exactly(2)
        assert flags == 0x04, f"expected a READY command, got flags {flags:#x}"
        self._read_exactly(size)

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
                raise ConnectionError("peer closed during the ZMTP handshake")
            data += chunk
        return data
