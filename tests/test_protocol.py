"""Wire protocol: round trips for every allowed dtype, zero-copy, and one rejection per case."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from stagefeed.common import protocol
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.spec import ALLOWED_DTYPES, BatchSpec


def _frames(arrays, producer="p-1", seq=7):
    """Encoded frames as received: each turned into its own bytes object."""
    return [bytes(f) for f in protocol.encode(producer, seq, arrays)]


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
def test_round_trip_every_allowed_dtype(dtype):
    rng = np.random.default_rng(0)
    array = (rng.random((3, 4, 5)) * 100).astype(np.dtype(dtype))
    batch = protocol.decode(_frames([("x", array)]))
    assert batch.producer == "p-1" and batch.seq == 7
    assert batch.arrays["x"].dtype == array.dtype
    np.testing.assert_array_equal(batch.arrays["x"], array)
    assert batch.nbytes == array.nbytes


def test_encode_is_zero_copy():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    frames = protocol.encode("p", 0, [("x", array)])
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == array.ctypes.data


def test_decode_is_zero_copy_over_the_received_frame():
    array = np.arange(24, dtype=np.int32)
    frames = _frames([("x", array)])
    batch = protocol.decode(frames)
    frame_address = np.frombuffer(frames[1], dtype=np.uint8).ctypes.data
    assert batch.arrays["x"].ctypes.data == frame_address
    assert not batch.arrays["x"].flags.writeable


def test_decode_accepts_zmq_frames_without_copy():
    zmq = pytest.importorskip("zmq")
    array = np.arange(1000, dtype=np.float32)
    frames = [zmq.Frame(bytes(f)) for f in protocol.encode("p", 1, [("x", array)])]
    batch = protocol.decode(frames)
    assert batch.arrays["x"].ctypes.data == np.frombuffer(frames[1].buffer, np.uint8).ctypes.data
    np.testing.assert_array_equal(batch.arrays["x"], array)


def _header(**fields):
    base = {"v": 1, "producer": "p", "seq": 0, "arrays": [["x", "<f4", [2]]]}
    base.update(fields)
    return msgpack.packb(base)


EIGHT_BYTES = b"\0" * 8

REJECTED = {
    "one part": ([b"only"], DropReason.PARTS),
    "too many parts": ([_header()] + [EIGHT_BYTES] * 20, DropReason.PARTS),
    "declared vs sent": ([_header(), EIGHT_BYTES, EIGHT_BYTES], DropReason.PARTS),
    "header too big": ([b"\x90" * 5000, EIGHT_BYTES], DropReason.HEADER_SIZE),
    "garbage header": ([b"\xc1\xc1\xc1", EIGHT_BYTES], DropReason.HEADER_NOT_MSGPACK),
    "trailing bytes": ([_header() + b"\x00", EIGHT_BYTES], DropReason.HEADER_NOT_MSGPACK),
    "ext type": (
        [msgpack.packb(msgpack.ExtType(1, b"x")), EIGHT_BYTES],
        DropReason.HEADER_NOT_MSGPACK,
    ),
    "header is a list": ([msgpack.packb([1, 2]), EIGHT_BYTES], DropReason.HEADER_NOT_MAP),
    "unknown version": ([_header(v=2), EIGHT_BYTES], DropReason.VERSION),
    "missing field": (
        [msgpack.packb({"v": 1, "producer": "p"}), EIGHT_BYTES],
        DropReason.HEADER_FIELDS,
    ),
    "extra field": ([_header(extra=1), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "seq negative": ([_header(seq=-1), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "seq not int": ([_header(seq="1"), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "seq bool": ([_header(seq=True), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "arrays not list": ([_header(arrays={"x": 1}), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "entry malformed": ([_header(arrays=[["x", "<f4"]]), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "duplicate names": (
        [_header(arrays=[["x", "<f4", [2]], ["x", "<f4", [2]]]), EIGHT_BYTES, EIGHT_BYTES],
        DropReason.HEADER_FIELDS,
    ),
    "producer empty": ([_header(producer=""), EIGHT_BYTES], DropReason.PRODUCER_ID),
    "producer odd chars": ([_header(producer="a b\n"), EIGHT_BYTES], DropReason.PRODUCER_ID),
    "producer not str": ([_header(producer=5), EIGHT_BYTES], DropReason.PRODUCER_ID),
    "object dtype": ([_header(arrays=[["x", "|O", [1]]]), EIGHT_BYTES], DropReason.DTYPE),
    "void dtype": ([_header(arrays=[["x", "|V8", [1]]]), EIGHT_BYTES], DropReason.DTYPE),
    "big endian": ([_header(arrays=[["x", ">f4", [2]]]), EIGHT_BYTES], DropReason.DTYPE),
    "dtype not str": ([_header(arrays=[["x", 4, [2]]]), EIGHT_BYTES], DropReason.DTYPE),
    "negative dim": ([_header(arrays=[["x", "<f4", [-2]]]), EIGHT_BYTES], DropReason.SHAPE),
    "zero dim": ([_header(arrays=[["x", "<f4", [0]]]), b""], DropReason.SHAPE),
    "huge dim": ([_header(arrays=[["x", "<f4", [2**40]]]), EIGHT_BYTES], DropReason.SHAPE),
    "too many dims": ([_header(arrays=[["x", "<f4", [1] * 9]]), EIGHT_BYTES], DropReason.SHAPE),
    "float dim": ([_header(arrays=[["x", "<f4", [2.0]]]), EIGHT_BYTES], DropReason.SHAPE),
    "frame too short": ([_header(arrays=[["x", "<f4", [3]]]), EIGHT_BYTES], DropReason.FRAME_SIZE),
    "frame too long": ([_header(arrays=[["x", "<f4", [1]]]), EIGHT_BYTES], DropReason.FRAME_SIZE),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_malformed_message_is_rejected_with_its_reason(case):
    frames, reason = REJECTED[case]
    with pytest.raises(ProtocolError) as info:
        protocol.decode(frames)
    assert info.value.reason is reason


def test_msgpack_numpy_object_payload_is_rejected_and_never_unpickled(tmp_path):
    """A msgpack-numpy map whose object array carries a pickle that would create a file."""
    msgpack_numpy = pytest.importorskip("msgpack_numpy")
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = np.array([Exploit()], dtype=object)
    hostile = msgpack.packb(payload, default=msgpack_numpy.encode)
    for frames in ([hostile, EIGHT_BYTES], [_header(), hostile]):
        with pytest.raises(ProtocolError) as info:
            protocol.decode(frames)
        assert info.value.reason in (
            DropReason.HEADER_FIELDS,
            DropReason.HEADER_NOT_MAP,
            DropReason.FRAME_SIZE,
        )
    assert not marker.exists()
    # The payload really is live: msgpack-numpy's own decoder would run it.
    msgpack.unpackb(hostile, object_hook=msgpack_numpy.decode, raw=False)
    assert marker.exists()


SPEC = BatchSpec(batch_size=2, height=4, width=4, channels=3, num_classes=10)


def _batch(images=None, labels=None, names=("images", "labels")):
    images = np.zeros(SPEC.image_shape, np.float32) if images is None else images
    labels = np.array([0, 9], np.int32) if labels is None else labels
    return protocol.decode(_frames(list(zip(names, (images, labels), strict=True))))


def test_spec_accepts_a_matching_batch():
    protocol.check_against_spec(_batch(), SPEC)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"images": np.zeros(SPEC.image_shape, np.uint8)},
        {"images": np.zeros((3, 4, 4, 3), np.float32)},
        {"labels": np.zeros(2, np.int64)},
        {"names": ("labels", "images")},
    ],
    ids=["dtype", "shape", "label dtype", "names"],
)
def test_spec_mismatch_is_rejected(kwargs):
    with pytest.raises(ProtocolError) as info:
        protocol.check_against_spec(_batch(**kwargs), SPEC)
    assert info.value.reason is DropReason.SPEC_MISMATCH


@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1])
def test_labels_out_of_range_are_rejected(bad):
    with pytest.raises(ProtocolError) as info:
        protocol.check_against_spec(_batch(labels=np.array([0, bad], np.int32)), SPEC)
    assert info.value.reason is DropReason.LABEL_RANGE


def test_encode_refuses_what_decode_would_reject():
    with pytest.raises(ValueError, match="not allowed"):
        protocol.encode("p", 0, [("x", np.array([object()], dtype=object))])
    with pytest.raises(ValueError, match="contiguous"):
        protocol.encode("p", 0, [("x", np.zeros((4, 4), np.float32)[:, ::2])])
    with pytest.raises(ValueError, match="producer id"):
        protocol.encode("bad id", 0, [("x", np.zeros(2, np.float32))])
