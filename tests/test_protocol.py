"""Wire protocol: round trips for every allowed dtype, zero-copy, and one rejection per case."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from stagefeed.common import protocol
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.schema import ALLOWED_DTYPES, image_schema


def _frames(arrays, seq=7):
    """Encoded frames as received: each turned into its own bytes object."""
    return [bytes(f) for f in protocol.encode_batch(seq, arrays)]


def _decode(frames):
    """What the intake does with a batch message: the header, then the arrays."""
    header = protocol.decode_header(frames[0], protocol.FROM_PRODUCER)
    return protocol.decode_batch(header, frames)


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
def test_round_trip_every_allowed_dtype(dtype):
    rng = np.random.default_rng(0)
    array = (rng.random((3, 4, 5)) * 100).astype(np.dtype(dtype))
    batch = _decode(_frames([("x", array)]))
    assert batch.seq == 7
    assert batch.arrays["x"].dtype == array.dtype
    np.testing.assert_array_equal(batch.arrays["x"], array)
    assert batch.nbytes == array.nbytes


def test_encode_is_zero_copy():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    frames = protocol.encode_batch(0, [("x", array)])
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data == array.ctypes.data


def test_decode_is_zero_copy_over_the_received_frame():
    array = np.arange(24, dtype=np.int32)
    frames = _frames([("x", array)])
    batch = _decode(frames)
    frame_address = np.frombuffer(frames[1], dtype=np.uint8).ctypes.data
    assert batch.arrays["x"].ctypes.data == frame_address
    assert not batch.arrays["x"].flags.writeable


def test_decode_accepts_zmq_frames_without_copy():
    zmq = pytest.importorskip("zmq")
    array = np.arange(1000, dtype=np.float32)
    frames = [zmq.Frame(bytes(f)) for f in protocol.encode_batch(1, [("x", array)])]
    batch = _decode(frames)
    assert batch.arrays["x"].ctypes.data == np.frombuffer(frames[1].buffer, np.uint8).ctypes.data
    np.testing.assert_array_equal(batch.arrays["x"], array)


def _header(**fields):
    base = {"v": 2, "t": "batch", "seq": 0, "arrays": [["x", "<f4", [2]]]}
    base.update(fields)
    return msgpack.packb(base)


EIGHT_BYTES = b"\0" * 8


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value

REJECTED = {
    "header only": ([_header()], DropReason.PARTS),
    "too many parts": ([_header()] + [EIGHT_BYTES] * 20, DropReason.PARTS),
    "too many arrays declared": (
        [_header(arrays=[[f"x{i}", "<f4", [2]] for i in range(17)])] + [EIGHT_BYTES] * 17,
        DropReason.PARTS,
    ),
    "declared vs sent": ([_header(), EIGHT_BYTES, EIGHT_BYTES], DropReason.PARTS),
    "header too big": ([b"\x90" * 17000, EIGHT_BYTES], DropReason.HEADER_SIZE),
    "garbage header": ([b"\xc1\xc1\xc1", EIGHT_BYTES], DropReason.HEADER_NOT_MSGPACK),
    "trailing bytes": ([_header() + b"\x00", EIGHT_BYTES], DropReason.HEADER_NOT_MSGPACK),
    "ext type": (
        [msgpack.packb(msgpack.ExtType(1, b"x")), EIGHT_BYTES],
        DropReason.HEADER_NOT_MSGPACK,
    ),
    "header is a list": ([msgpack.packb([1, 2]), EIGHT_BYTES], DropReason.HEADER_NOT_MAP),
    "unknown version": ([_header(v=1), EIGHT_BYTES], DropReason.VERSION),
    "unknown kind": ([_header(t="welcome"), EIGHT_BYTES], DropReason.KIND),
    "kind not str": ([_header(t=3), EIGHT_BYTES], DropReason.KIND),
    "missing field": (
        [msgpack.packb({"v": 2, "t": "batch"}), EIGHT_BYTES],
        DropReason.HEADER_FIELDS,
    ),
    "seq too big": ([_header(seq=2**63), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "deep nesting": ([_header(arrays=_nested(1000)), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "name too long": ([_header(arrays=[["x" * 65, "<f4", [2]]]), EIGHT_BYTES],
                      DropReason.HEADER_FIELDS),
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
    "producer claimed": ([_header(producer="victim-1"), EIGHT_BYTES], DropReason.HEADER_FIELDS),
    "object dtype": ([_header(arrays=[["x", "|O", [1]]]), EIGHT_BYTES], DropReason.DTYPE),
    "void dtype": ([_header(arrays=[["x", "|V8", [1]]]), EIGHT_BYTES], DropReason.DTYPE),
    "big endian": ([_header(arrays=[["x", ">f4", [2]]]), EIGHT_BYTES], DropReason.DTYPE),
    "dtype not str": ([_header(arrays=[["x", 4, [2]]]), EIGHT_BYTES], DropReason.DTYPE),
    "negative dim": ([_header(arrays=[["x", "<f4", [-2]]]), EIGHT_BYTES], DropReason.SHAPE),
    "zero dim": ([_header(arrays=[["x", "<f4", [0]]]), b""], DropReason.SHAPE),
    "huge dim": ([_header(arrays=[["x", "<f4", [2**40]]]), EIGHT_BYTES], DropReason.SHAPE),
    "too many dims": ([_header(arrays=[["x", "<f4", [1] * 10]]), EIGHT_BYTES], DropReason.SHAPE),
    "float dim": ([_header(arrays=[["x", "<f4", [2.0]]]), EIGHT_BYTES], DropReason.SHAPE),
    "frame too short": ([_header(arrays=[["x", "<f4", [3]]]), EIGHT_BYTES], DropReason.FRAME_SIZE),
    "frame too long": ([_header(arrays=[["x", "<f4", [1]]]), EIGHT_BYTES], DropReason.FRAME_SIZE),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_malformed_message_is_rejected_with_its_reason(case):
    frames, reason = REJECTED[case]
    with pytest.raises(ProtocolError) as info:
        _decode(frames)
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
            _decode(frames)
        assert info.value.reason in (
            DropReason.HEADER_FIELDS,
            DropReason.HEADER_NOT_MAP,
            DropReason.VERSION,
            DropReason.FRAME_SIZE,
        )
    assert not marker.exists()
    # The payload really is live: msgpack-numpy's own decoder would run it.
    msgpack.unpackb(hostile, object_hook=msgpack_numpy.decode, raw=False)
    assert marker.exists()


SCHEMA = image_schema(batch_size=2, image_size=4, num_classes=10)
IMAGE_SHAPE = SCHEMA.batch_shape(SCHEMA["images"])


def _batch(images=None, labels=None, names=("images", "labels")):
    images = np.zeros(IMAGE_SHAPE, np.float32) if images is None else images
    labels = np.array([0, 9], np.int32) if labels is None else labels
    return _decode(_frames(list(zip(names, (images, labels), strict=True))))


def test_schema_accepts_a_matching_batch():
    protocol.check_against_schema(_batch(), SCHEMA)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"images": np.zeros(IMAGE_SHAPE, np.uint8)},
        {"images": np.zeros((3, 4, 4, 3), np.float32)},
        {"labels": np.zeros(2, np.int64)},
        {"names": ("labels", "images")},
        {"names": ("images", "targets")},
    ],
    ids=["dtype", "shape", "label dtype", "order", "name not in schema"],
)
def test_schema_mismatch_is_rejected(kwargs):
    with pytest.raises(ProtocolError) as info:
        protocol.check_against_schema(_batch(**kwargs), SCHEMA)
    assert info.value.reason is DropReason.SPEC_MISMATCH


@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1])
def test_values_out_of_bounds_are_rejected(bad):
    with pytest.raises(ProtocolError) as info:
        protocol.check_against_schema(_batch(labels=np.array([0, bad], np.int32)), SCHEMA)
    assert info.value.reason is DropReason.VALUE_RANGE


def test_encode_refuses_what_decode_would_reject():
    with pytest.raises(ValueError, match="not allowed"):
        protocol.encode_batch(0, [("x", np.array([object()], dtype=object))])
    with pytest.raises(ValueError, match="contiguous"):
        protocol.encode_batch(0, [("x", np.zeros((4, 4), np.float32)[:, ::2])])


@pytest.mark.parametrize("kind", sorted(protocol.FROM_PRODUCER - {"batch"}))
def test_control_messages_round_trip(kind):
    fields = {
        "hello": {"name": "p-1", "schema": SCHEMA.to_dict()},
        "shm_batch": {"seq": 3, "desc": {"pool": "p1-ab", "slot": 0, "gen": 1, "seq": 3}},
        "end": {"seq": 12},
        "ping": {},
        "end_pass": {"seq": 30, "pass": 0},
        "leaving": {},
    }[kind]
    header = protocol.decode_header(protocol.encode_control(kind, **fields), protocol.FROM_PRODUCER)
    assert header == {"v": 2, "t": kind, **fields}


def test_a_hello_schema_is_parsed_and_checked():
    raw = protocol.encode_control("hello", name="p", schema=SCHEMA.to_dict())
    assert protocol.schema_of_hello(protocol.decode_header(raw, protocol.FROM_PRODUCER)) == SCHEMA
    forged = SCHEMA.to_dict()
    forged["arrays"][0]["dtype"] = "object"
    raw = protocol.encode_control("hello", name="p", schema=forged)
    with pytest.raises(ProtocolError) as info:
        protocol.schema_of_hello(protocol.decode_header(raw, protocol.FROM_PRODUCER))
    assert info.value.reason is DropReason.HELLO and "object" in info.value.detail


def test_trainer_messages_are_not_taken_from_a_producer():
    raw = protocol.encode_control("credit", n=5)
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(raw, protocol.FROM_PRODUCER)
    assert info.value.reason is DropReason.KIND
    assert protocol.decode_header(raw, protocol.FROM_TRAINER)["n"] == 5


SHM_WELCOME = {"shm_socket": "/run/stagefeed/pools.sock", "shm_token": "ab" * 16, "shm_slots": 6}
WELCOME = {"schema": SCHEMA.to_dict(), "max_message": 2**20, "credit": 2}


@pytest.mark.parametrize(
    ("kind", "fields", "kinds"),
    [
        ("hello", {"name": "p", "schema": None, "shm": True}, protocol.FROM_PRODUCER),
        ("welcome", {**WELCOME, **SHM_WELCOME}, protocol.FROM_TRAINER),
        ("welcome", WELCOME, protocol.FROM_TRAINER),
        ("release", {"pool": "p1-ab", "slot": 4095, "gen": 2**64 - 1}, protocol.FROM_TRAINER),
    ],
    ids=["hello-shm", "welcome-shm", "welcome-plain", "release"],
)
def test_shared_memory_fields_round_trip(kind, fields, kinds):
    raw = protocol.encode_control(kind, **fields)
    assert protocol.decode_header(raw, kinds) == {"v": 2, "t": kind, **fields}


def _control(kind, **fields):
    return msgpack.packb({"v": 2, "t": kind, **fields})


PASSES = {"pass": 1, "pass_start": 30, "pass_count": 3}


def test_the_fields_of_passes_round_trip_and_are_checked():
    hello = {"name": "p", "schema": None, "shard": 0, "shards": 2, "seek": True, "passes": True}
    raw = protocol.encode_control("hello", **hello)
    assert protocol.decode_header(raw, protocol.FROM_PRODUCER) == {"v": 2, "t": "hello", **hello}
    welcome = protocol.decode_header(_control("welcome", **WELCOME, **PASSES),
                                     protocol.FROM_TRAINER)  # fmt: skip
    assert protocol.passes_of_welcome(welcome) == (1, 30, 3)
    assert protocol.passes_of_welcome(protocol.decode_header(
        _control("welcome", **WELCOME), protocol.FROM_TRAINER)) is None  # fmt: skip
    nxt = protocol.decode_header(_control("next_pass", **{"pass": 2}), protocol.FROM_TRAINER)
    assert nxt["pass"] == 2
    for raw, kinds in [
        (_control("welcome", **WELCOME, **{**PASSES, "pass_count": 0}), protocol.FROM_TRAINER),
        (_control("welcome", **WELCOME, **{"pass": 1}), protocol.FROM_TRAINER),
        (_control("hello", name="p", schema=None, passes=1), protocol.FROM_PRODUCER),
        (_control("end_pass", seq=-1, **{"pass": 0}), protocol.FROM_PRODUCER),
        (_control("next_pass"), protocol.FROM_TRAINER),
    ]:
        with pytest.raises(ProtocolError) as info:
            protocol.decode_header(raw, kinds)
        assert info.value.reason is DropReason.HEADER_FIELDS
    late = protocol.decode_header(_control("welcome", **WELCOME, **{**PASSES, "pass": 4}),
                                  protocol.FROM_TRAINER)  # fmt: skip
    with pytest.raises(ProtocolError):
        protocol.passes_of_welcome(late)


SHM_REJECTED = {
    "welcome with part of the shm fields": _control(
        "welcome", **WELCOME, shm_socket="/x", shm_token="t"
    ),
    "welcome shm_slots 0": _control("welcome", **WELCOME, **{**SHM_WELCOME, "shm_slots": 0}),
    "welcome shm_socket not str": _control(
        "welcome", **WELCOME, **{**SHM_WELCOME, "shm_socket": 1}
    ),
    "welcome with an unknown optional": _control("welcome", **WELCOME, shm=True),
    "release slot out of range": _control("release", pool="p", slot=4096, gen=1),
    "release generation 0": _control("release", pool="p", slot=0, gen=0),
    "release slot bool": _control("release", pool="p", slot=True, gen=1),
    "release without gen": _control("release", pool="p", slot=0),
}


@pytest.mark.parametrize("case", sorted(SHM_REJECTED))
def test_malformed_shared_memory_control_is_rejected(case):
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(SHM_REJECTED[case], protocol.FROM_TRAINER)
    assert info.value.reason is DropReason.HEADER_FIELDS


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"name": "p", "schema": None, "shm": 1}, DropReason.HEADER_FIELDS),
        ({"name": "p", "schema": None, "shm": "yes"}, DropReason.HEADER_FIELDS),
        ({"name": "p", "schema": None, "shm_socket": "/x"}, DropReason.HEADER_FIELDS),
    ],
    ids=["shm int", "shm str", "welcome field in a hello"],
)
def test_a_hello_with_a_bad_shm_field_is_rejected(fields, reason):
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(_control("hello", **fields), protocol.FROM_PRODUCER)
    assert info.value.reason is reason


@pytest.mark.parametrize(
    "desc", [[1, 2], "p:0:1", None], ids=["list", "string", "nil"]
)
def test_a_shm_batch_whose_descriptor_is_not_a_map_is_rejected(desc):
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(_control("shm_batch", seq=0, desc=desc), protocol.FROM_PRODUCER)
    assert info.value.reason is DropReason.HEADER_FIELDS


def test_encode_refuses_a_partial_optional_group_and_unknown_fields():
    with pytest.raises(ValueError, match="missing"):
        protocol.encode_control("welcome", **WELCOME, shm_socket="/x")
    with pytest.raises(ValueError, match="unexpected"):
        protocol.encode_control("release", pool="p", slot=0, gen=1, extra=1)
    assert not protocol.FROM_PRODUCER & protocol.FROM_TRAINER


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"seq": 3}, ("ok", "")),  # every producer's end before reasons: ok
        ({"seq": 3, "reason": "source_error", "detail": "x: y"}, ("source_error", "x: y")),
        ({"seq": 3, "reason": "ok", "detail": ""}, ("ok", "")),
        ({"seq": 3, "reason": "\x1b[31mpwned", "detail": "a\nb\x00c"}, ("other", "a b c")),
    ],
    ids=["plain", "source-error", "explicit-ok", "unknown-reason-control-chars"],
)
def test_an_end_says_why_the_producer_leaves(fields, expected):
    header = protocol.decode_header(_control("end", **fields), protocol.FROM_PRODUCER)
    assert protocol.end_reason(header) == expected


@pytest.mark.parametrize(
    "fields",
    [
        {"seq": 3, "reason": "source_error"},  # reason without detail
        {"seq": 3, "detail": "x"},
        {"seq": 3, "reason": 7, "detail": "x"},
        {"seq": 3, "reason": "source_error", "detail": ["x"] * 10},
        {"seq": 3, "reason": "source_error", "detail": "x" * (protocol.MAX_DETAIL_LEN + 1)},
        {"seq": 3, "reason": "x" * 5000, "detail": ""},
    ],
    ids=["no-detail", "no-reason", "reason-int", "detail-list", "detail-long", "reason-huge"],
)
def test_a_malformed_end_reason_is_a_header_fields_drop(fields):
    with pytest.raises(ProtocolError) as info:
        protocol.decode_header(_control("end", **fields), protocol.FROM_PRODUCER)
    assert info.value.reason is DropReason.HEADER_FIELDS


def test_one_line_bounds_and_sanitises():
    assert protocol.one_line("a\r\nb\tc" + "d" * 1000) == "a  b c" + "d" * 294
    assert len(protocol.one_line("é" * 1000, 10)) == 10
