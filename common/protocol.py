"""Wire protocol: one batch is one ZeroMQ multipart message.

Frame 0 is a msgpack map, the header::

    {"v": 1, "producer": "host-1234-ab12cd", "seq": 17,
     "arrays": [["images", "<f4", [256, 227, 227, 3]], ["labels", "<i4", [256]]]}

Frames 1..n hold the raw bytes of each array, C order, in the header's order.

Decoding is zero-copy (``np.frombuffer`` over the received frame) and strict: every field is
type-checked, dtypes come from an allow-list, and shape x itemsize must equal the frame size.
Only plain msgpack reads the header, with extension types refused: no pickle, no
msgpack-numpy decoder ever sees received bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.spec import ALLOWED_DTYPES, BatchSpec

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 4096
MAX_ARRAYS = 16
MAX_NDIM = 8
MAX_DIM = 2**31 - 1
MAX_NAME_LEN = 64
HEADER_KEYS = frozenset(["v", "producer", "seq", "arrays"])
_PRODUCER_ID = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


@dataclasses.dataclass(frozen=True)
class Batch:
    """A decoded message. ``arrays`` are read-only views over the received frames."""

    producer: str
    seq: int
    arrays: dict[str, np.ndarray]
    nbytes: int


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


def encode(producer: str, seq: int, arrays: Sequence[tuple[str, np.ndarray]]) -> list[Any]:
    """Frames for one batch: the header bytes, then each array's buffer (no copy).

    Arrays must be C-contiguous and of an allowed dtype; the caller keeps them unmodified
    until ZeroMQ has sent them (see ``producer.sender``).
    """
    if not _PRODUCER_ID.fullmatch(producer):
        raise ValueError(f"producer id {producer!r} must match {_PRODUCER_ID.pattern}")
    specs = []
    frames: list[Any] = []
    for name, array in arrays:
        if array.dtype.str not in ALLOWED_DTYPES:
            raise ValueError(f"array {name!r}: dtype {array.dtype} is not allowed on the wire")
        if not array.flags.c_contiguous:
            raise ValueError(f"array {name!r} must be C-contiguous")
        specs.append([name, array.dtype.str, list(array.shape)])
        frames.append(memoryview(array).cast("B"))
    header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "producer": producer, "seq": seq, "arrays": specs}
    )
    return [header, *frames]


def decode(frames: Sequence[Any]) -> Batch:
    """Decode and validate one received message; raise ``ProtocolError`` if it is malformed.

    ``frames`` are buffer-protocol objects (``zmq.Frame``, ``bytes``). The returned arrays
    alias them.
    """
    if not 2 <= len(frames) <= 1 + MAX_ARRAYS:
        raise ProtocolError(DropReason.PARTS, f"{len(frames)} frames")
    header = _decode_header(memoryview(frames[0]))
    declared = header["arrays"]
    if len(declared) != len(frames) - 1:
        raise ProtocolError(
            DropReason.PARTS, f"header declares {len(declared)} arrays, got {len(frames) - 1}"
        )
    arrays: dict[str, np.ndarray] = {}
    total = 0
    for entry, frame in zip(declared, frames[1:], strict=True):
        name, dtype, shape = _check_array_entry(entry)
        if name in arrays:
            raise ProtocolError(DropReason.HEADER_FIELDS, f"array {name!r} declared twice")
        view = memoryview(frame)
        expected = math.prod(shape) * dtype.itemsize
        if view.nbytes != expected:
            raise ProtocolError(
                DropReason.FRAME_SIZE,
                f"array {name!r}: shape {shape} x {dtype.itemsize} B = {expected} B, "
                f"frame has {view.nbytes} B",
            )
        arrays[name] = np.frombuffer(view, dtype=dtype).reshape(shape)
        total += view.nbytes
    return Batch(header["producer"], header["seq"], arrays, total)


def check_against_spec(batch: Batch, spec: BatchSpec) -> None:
    """Raise ``ProtocolError`` unless ``batch`` is exactly what the trainer was configured for."""
    expected = spec.arrays()
    if [name for name, _, _ in expected] != list(batch.arrays):
        raise ProtocolError(
            DropReason.SPEC_MISMATCH,
            f"arrays {list(batch.arrays)}, expected {[n for n, _, _ in expected]}",
        )
    for name, dtype, shape in expected:
        array = batch.arrays[name]
        if array.dtype != dtype or array.shape != shape:
            raise ProtocolError(
                DropReason.SPEC_MISMATCH,
                f"{name}: {array.dtype}{list(array.shape)}, expected {dtype}{list(shape)}",
            )
    labels = batch.arrays["labels"]
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= spec.num_classes:
        raise ProtocolError(
            DropReason.LABEL_RANGE,
            f"labels span [{low}, {high}], allowed [0, {spec.num_classes})",
        )


def _decode_header(raw: memoryview) -> dict[str, Any]:
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(DropReason.HEADER_SIZE, f"{raw.nbytes} B > {MAX_HEADER_BYTES} B")
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        detail = f"{type(exc).__name__}: {exc}"  # some msgpack errors have no message
        raise ProtocolError(DropReason.HEADER_NOT_MSGPACK, detail[:200]) from None
    if not isinstance(header, dict):
        raise ProtocolError(DropReason.HEADER_NOT_MAP, type(header).__name__)
    if "v" in header and header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(DropReason.VERSION, f"version {header['v']!r}")
    if set(header) != HEADER_KEYS:
        raise ProtocolError(DropReason.HEADER_FIELDS, f"keys {sorted(map(str, header))}")
    producer, seq, arrays = header["producer"], header["seq"], header["arrays"]
    if not isinstance(producer, str) or not _PRODUCER_ID.fullmatch(producer):
        raise ProtocolError(DropReason.PRODUCER_ID, repr(producer)[:80])
    if not _is_int(seq) or not 0 <= seq < 2**63:
        raise ProtocolError(DropReason.HEADER_FIELDS, f"seq {seq!r}"[:80])
    if not isinstance(arrays, list):
        raise ProtocolError(DropReason.HEADER_FIELDS, "arrays is not a list")
    return header


def _check_array_entry(entry: Any) -> tuple[str, np.dtype, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise ProtocolError(DropReason.HEADER_FIELDS, f"array entry {entry!r}"[:120])
    name, dtype_str, shape = entry
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise ProtocolError(DropReason.HEADER_FIELDS, f"array name {name!r}"[:120])
    # Checked against the allow-list *before* numpy parses it.
    if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
        raise ProtocolError(DropReason.DTYPE, f"{name}: dtype {dtype_str!r}"[:120])
    if (
        not isinstance(shape, list)
        or not 0 < len(shape) <= MAX_NDIM
        or not all(_is_int(d) and 0 < d <= MAX_DIM for d in shape)
    ):
        raise ProtocolError(DropReason.SHAPE, f"{name}: shape {shape!r}"[:120])
    return name, np.dtype(dtype_str), tuple(shape)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
