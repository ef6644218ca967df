"""Hypothesis profiles, strategies and the per-call bounds of the decoder fuzz tests.

Shared by ``tests/test_fuzz_protocol.py`` (the decoders) and ``tests/test_fuzz_intake.py``
(a live intake). Importing this module loads the profile ``HYPOTHESIS_PROFILE`` names
(``quick`` by default, ``fuzz`` for ``make fuzz``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tracemalloc
from collections.abc import Iterator

import msgpack
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from stagefeed.common import protocol
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.schema import (
    ALLOWED_DTYPES,
    DTYPES,
    MAX_ARRAYS,
    MAX_DIM,
    MAX_NAME_LEN,
    ArraySpec,
    Schema,
)

settings.register_profile(
    "quick",
    max_examples=200,
    deadline=1000,  # ms per example, on a loaded shared 2-core machine
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz",
    max_examples=5000,
    deadline=2000,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))

# A header is at most 16 KiB: decoding one allocates a few objects per byte at most.
MEMORY_BOUND = 8 * 2**20
MAX_FRAME = 4096  # bytes of a generated data frame
DEFAULT_RECURSION_LIMIT = 1000  # CPython's, under which the trainer's threads run
THREAD_FRAMES = 20  # about how deep a trainer thread is when it checks a message

# -- strategies ----------------------------------------------------------------------------------

INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]),
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.binary(max_size=24),
)
# Map keys: str and bytes pass msgpack's strict_map_key; ints and nil must be refused.
KEYS = st.one_of(st.text(max_size=12), st.binary(max_size=8), st.integers(-5, 5), st.none())
KINDS = sorted(protocol.FROM_PRODUCER | protocol.FROM_TRAINER)
FIELDS = ["v", "t", "name", "schema", "seq", "arrays", "max_message", "credit", "n", "reason",
          "detail"]  # fmt: skip


values = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=6), st.dictionaries(KEYS, children, max_size=6)
    ),
    max_leaves=24,
)


@st.composite
def deep(draw) -> bytes:
    """msgpack bytes of one leaf inside 1..1100 lists or single-key maps (msgpack: 1023)."""
    depth = draw(st.integers(1, 1100))
    leaf = msgpack.packb(draw(LEAVES))
    wrapper = draw(st.sampled_from([b"\x91", b"\x81" + msgpack.packb("a")]))
    return wrapper * depth + leaf


@st.composite
def map_with_raw(draw, fields: dict) -> bytes:
    """A msgpack map of ``fields`` where one value may be replaced by deeply nested bytes."""
    items = [(msgpack.packb(k), msgpack.packb(v)) for k, v in fields.items()]
    if items and draw(st.booleans()):
        i = draw(st.integers(0, len(items) - 1))
        items[i] = (items[i][0], draw(deep()))
    if len(items) >= 16:
        items = items[:15]
    return bytes([0x80 | len(items)]) + b"".join(k + v for k, v in items)


names = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,10}", fullmatch=True),
    st.text(max_size=MAX_NAME_LEN + 4),
    st.just("x" * (MAX_NAME_LEN + 1)),
    values,
)
dtype_strs = st.one_of(
    st.sampled_from(sorted(ALLOWED_DTYPES)),
    st.sampled_from(["|O", "<c8", "|V8", "<U1", ">f4", "|S4", "<M8[s]", "float32", "f4", "O",
                     "", "<f4,<i4", "(2)i4", "|b1 "]),
    values,
)  # fmt: skip
small_dims = st.lists(st.integers(1, 4), min_size=1, max_size=4)
shapes = st.one_of(
    small_dims,
    st.lists(st.one_of(st.integers(-3, 5), st.sampled_from([0, MAX_DIM, MAX_DIM + 1, 2**40]),
                       st.booleans(), st.floats(0, 5)), max_size=11),
    values,
)  # fmt: skip
entries = st.one_of(st.tuples(names, dtype_strs, shapes).map(list), values)
arrays_fields = st.one_of(st.lists(entries, max_size=MAX_ARRAYS + 2), values)


@st.composite
def field_value(draw, key: str):
    """A value for header field ``key``: mostly of the right type, often at an edge."""
    right = {
        "v": st.one_of(st.just(protocol.PROTOCOL_VERSION), st.sampled_from([1, 3, 2.0, True])),
        "t": st.sampled_from(KINDS + ["nope", ""]),
        "name": st.one_of(st.text(max_size=70), st.just("good")),
        "schema": st.one_of(st.none(), schema_dicts()),
        "seq": INTS,
        "arrays": arrays_fields,
        "max_message": INTS,
        "credit": INTS,
        "n": INTS,
        "reason": st.text(max_size=20),
        "detail": st.text(max_size=400),
        # shared-memory fields (shm_batch, release, the optional hello/welcome keys)
        "desc": st.one_of(
            st.dictionaries(st.sampled_from(["pool", "slot", "gen", "seq"]), INTS), values
        ),
        "pool": st.text(max_size=40),
        "slot": INTS,
        "gen": INTS,
        "shm": st.booleans(),
        "shm_socket": st.text(max_size=120),
        "shm_token": st.text(max_size=80),
        "shm_slots": INTS,
    }.get(key, values)
    return draw(st.one_of(right, right, values))


@st.composite
def header_dicts(draw) -> dict:
    """A header map with the fields of some kind, each possibly bent, some missing or extra."""
    kind = draw(st.sampled_from(KINDS))
    wanted = ["v", "t", *protocol._FIELDS[kind]]  # noqa: SLF001 - the field table, by kind
    header = {k: draw(field_value(k)) for k in wanted if draw(st.integers(0, 9)) > 0}
    if "t" in header and draw(st.booleans()):
        header["t"] = kind
    for _ in range(draw(st.integers(0, 2))):
        header[draw(st.sampled_from(FIELDS + ["producer", "x"]))] = draw(values)
    return header


@st.composite
def header_bytes(draw) -> bytes:
    """Bytes as a header frame: packed bent headers, arbitrary structures, raw or mutated."""
    how = draw(st.sampled_from(["header", "header-raw", "value", "deep", "binary", "mutated",
                                "huge"]))  # fmt: skip
    if how == "header":
        return pack(draw(header_dicts()))
    if how == "header-raw":
        return draw(map_with_raw(draw(header_dicts())))
    if how == "value":
        return pack(draw(values))
    if how == "deep":
        return draw(deep())
    if how == "binary":
        return draw(st.binary(max_size=2048))
    if how == "huge":
        return draw(st.binary(min_size=protocol.MAX_HEADER_BYTES - 2,
                              max_size=protocol.MAX_HEADER_BYTES + 2))  # fmt: skip
    raw = bytearray(pack(draw(header_dicts())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del raw[pos : pos + draw(st.integers(1, 8))]
        else:
            raw[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    return bytes(raw)


def pack(value) -> bytes:
    try:
        return msgpack.packb(value)
    except (ValueError, TypeError, OverflowError):  # a key msgpack cannot pack: any bytes then
        return b"\xc1"


@st.composite
def spec_dicts(draw) -> dict:
    """An array entry of a schema declaration, valid or bent."""
    d = {"name": draw(st.one_of(names, st.from_regex(r"[a-z]{1,8}", fullmatch=True))),
         "dtype": draw(st.one_of(st.sampled_from(sorted(DTYPES)), values))}  # fmt: skip
    if draw(st.booleans()):
        d["shape"] = draw(st.one_of(st.lists(st.integers(1, 8), max_size=3), shapes))
    if draw(st.integers(0, 3)) == 0:
        d["bounds"] = draw(st.one_of(st.tuples(INTS, INTS).map(list), values))
    if draw(st.integers(0, 4)) == 0:
        d["cast"] = draw(st.one_of(st.sampled_from(["float16", "float32", "int8"]), values))
    if draw(st.integers(0, 4)) == 0:
        d["scale"] = draw(st.one_of(st.floats(allow_nan=True), values))
    if draw(st.integers(0, 9)) == 0:
        d[draw(st.text(max_size=6))] = draw(values)
    return d


@st.composite
def schema_dicts(draw) -> dict:
    d = {
        "batch_size": draw(st.one_of(st.integers(1, 8), INTS, values)),
        "arrays": draw(st.one_of(st.lists(spec_dicts(), max_size=MAX_ARRAYS + 1), values)),
    }
    if draw(st.integers(0, 9)) == 0:
        del d[draw(st.sampled_from(["batch_size", "arrays"]))]
    if draw(st.integers(0, 9)) == 0:
        d[draw(st.text(max_size=6))] = draw(values)
    return d


@st.composite
def valid_schemas(draw) -> Schema:
    """Schemas ``Schema`` accepts: small arrays of every dtype, some bounded integers."""
    specs = []
    for name in draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True),
                              min_size=1, max_size=4, unique=True)):  # fmt: skip
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        bounds = None
        if np.dtype(DTYPES[dtype]).kind in "iu" and draw(st.booleans()):
            info = np.iinfo(np.dtype(DTYPES[dtype]))
            # msgpack carries integers below 2**64: the schema refuses a high bound of 2**64.
            lowest, top = int(info.min), min(int(info.max) + 1, 2**64 - 1)
            low = draw(st.one_of(st.integers(lowest, top - 1), st.just(lowest)))
            high = draw(st.one_of(st.integers(low + 1, top), st.just(top)))
            bounds = (low, high)
        specs.append(ArraySpec(name, dtype, shape, bounds=bounds))
    return Schema(tuple(specs), draw(st.integers(1, 3)))


# -- the bound every call is held to ------------------------------------------------------------


@contextlib.contextmanager
def trainer_recursion_limit(here: bool = False) -> Iterator[None]:
    """The recursion room of a trainer's thread for the duration. Hypothesis raises the
    (process-wide) limit by about 2000 frames while a test runs, which hides the very defect
    these tests look for: ``repr`` of a value ~1000 deep raises ``RecursionError`` in a
    trainer (default limit, shallow threads) and not under the raised limit.

    ``here``: a call in this thread gets what a trainer thread has above its current depth,
    the same wherever Hypothesis calls from (so an example fails alike when replayed).
    Otherwise the default limit, for the intake's own shallow threads (this thread keeps at
    least 100 frames of room).
    """
    raised = sys.getrecursionlimit()
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    if here:
        sys.setrecursionlimit(depth + DEFAULT_RECURSION_LIMIT - THREAD_FRAMES)
    else:
        sys.setrecursionlimit(max(DEFAULT_RECURSION_LIMIT, depth + 100))
    try:
        yield
    finally:
        sys.setrecursionlimit(raised)


def bounded(fn, *args, allowed: tuple[type[BaseException], ...] = (ProtocolError,)):
    """``fn(*args)`` under tracemalloc and the trainer's recursion limit: its result, or the
    allowed exception it raised.

    Any other exception propagates (Hypothesis reports it); the traced peak must stay within
    ``MEMORY_BOUND``.
    """
    tracemalloc.start()
    try:
        try:
            with trainer_recursion_limit(here=True):
                result = fn(*args)
        except allowed as exc:
            result = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= MEMORY_BOUND, f"{fn.__name__} traced {peak} B > {MEMORY_BOUND} B"
    if isinstance(result, ProtocolError):
        assert isinstance(result.reason, DropReason)
        assert len(str(result)) < 2000, "an error message must quote bounded excerpts only"
    return result
