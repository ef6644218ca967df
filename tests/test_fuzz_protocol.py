"""Property-based fuzzing of the wire decoders and the schema parser (Hypothesis).

Whatever the bytes, ``protocol.decode_header`` / ``decode_batch`` / ``check_against_schema`` /
``schema_of_hello`` / ``check_producer_name``, ``Descriptor.parse`` (slot
descriptors) and ``PoolAnnounce.from_wire`` (pool announces) raise nothing but
``ProtocolError`` and ``Schema.from_dict`` nothing but ``ConfigError``; each call stays within
a per-example time (Hypothesis ``deadline``), a memory bound (tracemalloc peak,
``MEMORY_BOUND``) and the recursion room of a trainer's thread (Hypothesis raises the limit
while a test runs, which would hide a ``repr`` of a value 1000 deep). Inputs: arbitrary
msgpack structures (nested lists, maps, ints, strings, bytes, floats, bools, nil, up to past
msgpack's own nesting limit), headers bent one field at a time, raw and mutated bytes, frame
lists sized right or wrong for what a header declares, and descriptors, announces and ``end``
headers with values nested past Python's recursion limit, oversized or mistyped.

Budgets: the ``quick`` profile (default, ``make test``) runs ~200 examples a property; the
``fuzz`` profile (``HYPOTHESIS_PROFILE=fuzz``, ``make fuzz``) thousands. No example database
is written: a failure prints the example and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stagefeed.common import protocol
from stagefeed.common.errors import ConfigError, DropReason, ProtocolError
from stagefeed.common.schema import (
    ALLOWED_DTYPES,
    MAX_ARRAYS,
    ArraySpec,
    Schema,
)
from stagefeed.common.shm.layout import PoolAnnounce
from stagefeed.common.shm.mapped import DESCRIPTOR_KEYS, Descriptor
from tests.helpers.fuzz_shm_strategies import (
    announces,
    built,
    descriptors,
    end_headers,
    packed_with_deep,
)
from tests.helpers.fuzz_strategies import (
    MAX_FRAME,
    arrays_fields,
    bounded,
    entries,
    header_bytes,
    header_dicts,
    map_with_raw,
    pack,
    schema_dicts,
    valid_schemas,
    values,
)

# -- properties ---------------------------------------------------------------------------------

direction = st.sampled_from([protocol.FROM_PRODUCER, protocol.FROM_TRAINER])


@given(raw=header_bytes(), kinds=direction)
def test_decode_header_raises_only_protocol_error(raw, kinds):
    header = bounded(protocol.decode_header, raw, kinds)
    if isinstance(header, ProtocolError):
        return
    # What passes is exactly what the field table says.
    assert header["v"] == protocol.PROTOCOL_VERSION and header["t"] in kinds
    fields = protocol._FIELDS[header["t"]]  # noqa: SLF001
    assert set(header) == {"v", "t", *fields}
    for key, types in fields.items():
        assert isinstance(header[key], types) and not isinstance(header[key], bool)


@given(header=header_dicts(), kinds=direction)
def test_decode_header_of_bent_headers(header, kinds):
    raw = pack(header)
    result = bounded(protocol.decode_header, raw, kinds)
    if not isinstance(result, ProtocolError):
        assert result == msgpack.unpackb(raw, raw=False)


@st.composite
def batch_messages(draw):
    """(header bytes, frames): a batch header with its arrays bent, and data frames sized right
    for the declaration (often), or wrong, or in the wrong number."""
    arrays = draw(st.one_of(st.lists(entries, max_size=MAX_ARRAYS + 2), arrays_fields))
    head = {"v": protocol.PROTOCOL_VERSION, "t": "batch", "seq": draw(st.integers(0, 2**63 - 1)),
            "arrays": arrays}  # fmt: skip
    raw = draw(map_with_raw(head)) if draw(st.integers(0, 4)) == 0 else pack(head)
    frames = [raw]
    declared = arrays if isinstance(arrays, list) else []
    for entry in declared:
        size = _declared_size(entry)
        if size is not None and size <= MAX_FRAME and draw(st.integers(0, 3)) > 0:
            size += draw(st.sampled_from([0, 0, 0, -1, 1]))
            frames.append(draw(st.binary(min_size=max(0, size), max_size=max(0, size))))
        else:
            frames.append(draw(st.binary(max_size=64)))
    extra = draw(st.sampled_from([0, 0, 0, 1, -1]))
    if extra > 0:
        frames.append(b"\0" * draw(st.integers(0, 8)))
    elif extra < 0 and len(frames) > 1:
        frames.pop()
    return raw, frames


def _declared_size(entry) -> int | None:
    """Bytes an array entry declares, if it is well-formed enough to say."""
    if not (isinstance(entry, list) and len(entry) == 3):
        return None
    _, dtype, shape = entry
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES or not isinstance(shape, list):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return None
    return math.prod(shape) * np.dtype(dtype).itemsize


@given(message=batch_messages())
def test_decode_batch_raises_only_protocol_error(message):
    raw, frames = message
    header = bounded(protocol.decode_header, raw, protocol.FROM_PRODUCER)
    assume(not isinstance(header, ProtocolError))
    batch = bounded(protocol.decode_batch, header, frames)
    if isinstance(batch, ProtocolError):
        return
    # A decoded batch: read-only views over the frames, with the declared names and shapes.
    assert batch.seq == header["seq"]
    assert list(batch.arrays) == [entry[0] for entry in header["arrays"]]
    assert batch.nbytes == sum(len(f) for f in frames[1:])
    for (name, dtype, shape), frame in zip(header["arrays"], frames[1:], strict=True):
        array = batch.arrays[name]
        assert array.dtype.str == dtype and list(array.shape) == shape
        assert not array.flags.writeable
        assert array.tobytes() == bytes(frame)


@st.composite
def batches_for(draw):
    """(schema, batch): a decoded batch made for the schema, or bent from it."""
    schema = draw(valid_schemas())
    arrays = []
    for spec in schema.arrays:
        shape = list(schema.batch_shape(spec))
        dtype = spec.np_dtype
        how = draw(st.sampled_from(["right", "right", "right", "dtype", "shape", "values"]))
        if how == "dtype":
            dtype = np.dtype(draw(st.sampled_from(sorted(ALLOWED_DTYPES))))
        elif how == "shape":
            shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
        count = math.prod(shape)
        data = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
        array = np.frombuffer(data, dtype=dtype).reshape(shape)
        if how != "values" and spec.bounds is not None and dtype == spec.np_dtype:
            low, high = spec.bounds
            array = (array.astype(object) % (high - low) + low).astype(dtype)
        arrays.append((spec.name, np.ascontiguousarray(array)))
    if draw(st.integers(0, 5)) == 0:
        draw(st.randoms()).shuffle(arrays)
    if len(arrays) > 1 and draw(st.integers(0, 5)) == 0:
        arrays.pop()
    frames = [bytes(f) for f in protocol.encode_batch(draw(st.integers(0, 9)), arrays)]
    header = protocol.decode_header(frames[0], protocol.FROM_PRODUCER)
    return schema, protocol.decode_batch(header, frames)


def _problems(batch: protocol.Batch, schema: Schema) -> set[str]:
    """The independent oracle: the reasons the batch is not what the schema says (none: it is).

    Names first (nothing else is comparable then), then per array dtype/shape and bounds.
    """
    if list(batch.arrays) != list(schema.names):
        return {"spec_mismatch"}
    problems = set()
    for spec in schema.arrays:
        array = batch.arrays[spec.name]
        if array.dtype != spec.np_dtype or array.shape != schema.batch_shape(spec):
            problems.add("spec_mismatch")
        elif spec.bounds is not None and not all(
            spec.bounds[0] <= int(v) < spec.bounds[1] for v in array.reshape(-1).tolist()
        ):
            problems.add("value_range")
    return problems


@given(case=batches_for())
def test_check_against_schema_agrees_with_an_independent_oracle(case):
    schema, batch = case
    result = bounded(protocol.check_against_schema, batch, schema)
    expected = _problems(batch, schema)
    if not expected:
        assert result is None
    else:  # with both kinds of problem, either may be named first
        assert isinstance(result, ProtocolError) and result.reason.value in expected


@given(declared=st.one_of(schema_dicts(), values, st.none()))
def test_schema_from_dict_raises_only_config_error(declared):
    result = bounded(Schema.from_dict, declared, allowed=(ConfigError,))
    if isinstance(result, Schema):
        assert Schema.from_dict(result.to_dict()) == result


@given(declared=st.one_of(schema_dicts(), st.none()), name=st.text(max_size=80))
def test_schema_of_hello_and_name_raise_only_protocol_error(declared, name):
    header = {"v": protocol.PROTOCOL_VERSION, "t": "hello", "name": name, "schema": declared}
    # As on the wire: packed and decoded first (what the intake hands these functions).
    decoded = bounded(protocol.decode_header, pack(header), protocol.FROM_PRODUCER)
    assume(not isinstance(decoded, ProtocolError))
    schema = bounded(protocol.schema_of_hello, decoded)
    if isinstance(schema, ProtocolError):
        assert schema.reason is DropReason.HELLO
    else:
        assert schema is None or isinstance(schema, Schema)
    checked = bounded(protocol.check_producer_name, decoded["name"])
    if not isinstance(checked, ProtocolError):
        assert checked == name and 0 < len(name) <= protocol.MAX_PRODUCER_NAME


@given(schema=valid_schemas())
def test_valid_schemas_round_trip_through_a_hello(schema):
    # Known not to travel: see test_a_schema_with_uint64_full_range_bounds_can_be_sent.
    assume(not any(a.bounds and a.bounds[1] > 2**64 - 1 for a in schema.arrays))
    raw = protocol.encode_control("hello", name="p", schema=schema.to_dict())
    header = protocol.decode_header(raw, protocol.FROM_PRODUCER)
    assert protocol.schema_of_hello(header) == schema


def test_a_schema_bound_msgpack_cannot_carry_is_refused_at_construction():
    # A welcome must carry the schema: bounds of [0, 2**64) would not encode (OverflowError
    # at every hello), so the schema refuses them when it is made, naming the value.
    with pytest.raises(ConfigError, match="18446744073709551616"):
        ArraySpec("ids", "uint64", (), bounds=(0, 2**64))
    schema = Schema((ArraySpec("ids", "uint64", (), bounds=(0, 2**64 - 1)),), 2)
    raw = protocol.encode_control("welcome", schema=schema.to_dict(), max_message=2**20, credit=1)
    header = protocol.decode_header(raw, protocol.FROM_TRAINER)
    assert Schema.from_dict(header["schema"]) == schema


@settings(max_examples=20)
@given(depth=st.integers(900, 1023), field=st.sampled_from(["arrays", "seq", "v", "t", "x"]))
def test_nesting_up_to_msgpacks_limit_is_dropped_not_raised(depth, field):
    """The v1 bug: a header nested ~1000 deep reached a ``repr()`` and killed the thread."""
    fields = {"v": protocol.PROTOCOL_VERSION, "t": "batch", "seq": 0, "arrays": []}
    fields.pop(field, None)
    head = bytes([0x80 | (len(fields) + 1)]) + b"".join(
        msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items()
    ) + msgpack.packb(field) + b"\x91" * (depth - 1) + b"\x90"  # fmt: skip
    header = bounded(protocol.decode_header, head, protocol.FROM_PRODUCER)
    if not isinstance(header, ProtocolError):
        result = bounded(protocol.decode_batch, header, [head, b"\0"])
        assert isinstance(result, ProtocolError)


# -- shared memory and end: what the intake and the pools thread take besides batches ----------


@given(desc=descriptors)
def test_a_slot_descriptor_raises_only_protocol_error(desc):
    """Any descriptor (fields nested past repr's limit, oversized, mistyped, missing, extra)
    is parsed or refused as ``shm_descriptor``, in bounded time, memory and text."""
    desc = built(desc)
    result = bounded(Descriptor.parse, desc)
    if isinstance(result, ProtocolError):
        assert result.reason is DropReason.SHM_DESCRIPTOR
        return
    assert isinstance(desc, dict) and set(desc) == DESCRIPTOR_KEYS
    assert result == (desc["pool"], desc["slot"], desc["gen"], desc["seq"])


@given(announce=announces)
def test_a_pool_announce_raises_only_protocol_error(announce):
    """What the pools thread hands ``PoolAnnounce.from_wire`` (a received map, any nesting):
    an announce, or a ``ProtocolError`` of ``header_fields`` / ``version``."""
    announce = built(announce)
    result = bounded(PoolAnnounce.from_wire, announce)
    if isinstance(result, ProtocolError):
        assert result.reason in (DropReason.HEADER_FIELDS, DropReason.VERSION)
        return
    assert result.to_wire() == announce


@given(announce=announces)
def test_a_received_pool_announce_raises_only_protocol_error(announce):
    """The same through msgpack, as ``common.shm.fd_passing`` reads the announce off its socket
    (values nested past the packer's limit written as raw bytes)."""
    raw = packed_with_deep(announce)
    assume(len(raw) <= 64 * 1024)  # the fd channel's message limit
    try:
        received = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return  # refused by the channel (header_not_msgpack) before any parsing
    result = bounded(PoolAnnounce.from_wire, received)
    assert isinstance(result, (ProtocolError, PoolAnnounce))


@given(raw=end_headers())
def test_an_end_header_raises_only_protocol_error(raw):
    header = bounded(protocol.decode_header, raw, protocol.FROM_PRODUCER)
    if isinstance(header, ProtocolError):
        return
    assert set(header) - {"reason", "detail"} == {"v", "t", "seq"} and header["t"] == "end"
    assert type(header["seq"]) is int and 0 <= header["seq"] < 2**63
    reason, detail = protocol.end_reason(header)
    assert reason in protocol.END_REASONS | {protocol.END_OTHER}
    assert len(detail) <= protocol.MAX_DETAIL_LEN and (not detail or detail.isprintable())
