"""Messages a hostile or broken peer could send the trainer (wire protocol v2).

Builders return the frames of one ZeroMQ multipart message as a DEALER sends it (the trainer's
ROUTER adds the routing id). ``good_frames`` is the real encoder's output
(``common.protocol.encode_batch``); the others bend one thing at a time.
"""

from __future__ import annotations

import pathlib
import random
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np

from stagefeed.common import protocol
from stagefeed.common.schema import Schema

IMAGE_SHAPE = [2, 227, 227, 3]
NUM_CLASSES = 1000
V = protocol.PROTOCOL_VERSION
_rng = random.Random(4)


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
