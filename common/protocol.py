"""Wire protocol v2: producers (DEALER) talk to the trainer (ROUTER), one message per batch.

Every message starts with a msgpack map, the header, ``{"v": 2, "t": KIND, ...}``. From a
producer:

- ``hello``  ``{"name": str, "schema": Schema.to_dict() | None[, "shm": true][, "session":
  str]}``: first on every connection; ``None`` asks for the trainer's schema; ``shm`` says the
  producer can hand batches over in shared memory (docs/shm.md); ``session`` is 32 hex digits
  the producer drew once for its run, the same in every hello on every connection, and kept
  secret: the trainer links the books of connections by it alone, never by ``name``.
  ``shard``, ``shards``, ``seek`` (together): this producer is shard ``shard`` of ``shards``
  (a stream identity that survives restarts, docs/resume.md) and numbers its batches along
  that shard's whole stream; ``seek``: its source can start at any batch (else the producer
  fast-forwards it, and the trainer calls that shard's position approximate).
  ``confirm`` (true; only with ``shard``): this producer can stay after its ``end`` until a
  checkpoint holds all of its shard (``saved``), so that a trainer killed before that gets
  the tail again from it (docs/resume.md).
  ``group_first``, ``group_shards`` (together; only with ``shard``), ``group_stride`` (1 if
  absent): the shards of this producer's ``produce`` command, ``group_shards`` of them from
  ``group_first``, ``group_stride`` apart; a trainer that waits only for shards that joined it
  (a cluster worker) waits for these too, once one of them delivered.
  ``ack_end`` (true): this producer waits, before it closes, for the trainer's ``ended``.
  ``order_source``, ``order_records``, ``order_seed``, ``order_shuffle``: common/data_order.py.
- ``batch``  ``{"seq": int, "arrays": [[name, dtype.str, shape], ...]}``, then one raw frame
  per array, C order, in the header's order. Sent only against credit (see below).
- ``shm_batch`` ``{"seq": int, "desc": {"pool", "slot", "gen", "seq"}}``: a batch committed in
  a slot of the producer's shared-memory pool (one frame, no data). Sent only against credit,
  like ``batch``; ``desc`` is checked by ``common.shm.mapped`` (``shm_*`` drop reasons).
- ``end``    ``{"seq": int[, "reason": str, "detail": str]}``: the producer's bye: it has sent
  its last batch, ``seq`` batches (0..seq-1), and says why it leaves. Without ``reason`` (the
  form every producer sent before reasons existed, and the one a producer still sends when its
  source simply ended) the reason is ``ok``. ``source_error``: the source failed (a
  ``SchemaMismatch``, an exception of user code); the batches before the failure were
  delivered, and ``detail`` is the error's text, one printable line of at most
  ``MAX_DETAIL_LEN`` characters. A trainer books any other reason as ``other``
  (``end_reason``). Compatibility, both ways: a trainer from before reasons drops an ``end``
  that carries one (``header_fields``), which is what it saw of a failed producer then (no
  ``end`` at all); a normal end is the same message as ever. ``bad``, ``bad_first``
  (together): the producer's source skipped ``bad`` bad records in this stream
  (``--on-bad-record skip``), the first of them named in one line.
- ``ping``   ``{}``: still here (sent while idle, so the trainer keeps its credit).
- ``end_pass`` ``{"seq": int, "pass": int}``: (a hello that said ``passes``) pass ``pass`` of
  this shard ended: its batches are ``..seq-1``, the next pass starts at ``seq``. Sent after
  the pass's last batch; the producer's unused credit returns to the trainer, and it makes
  no batch of the next pass before ``next_pass`` (docs/resume.md, "Passes").
- ``leaving`` ``{}``: (after the trainer's ``saved``) the producer got it and leaves. A trainer
  closing waits a moment for it, since a message can be lost with the connection it came on.

From the trainer:

- ``welcome`` ``{"schema": dict, "max_message": int, "credit": int[, "shm_socket": str,
  "shm_token": str, "shm_slots": int]}``: hello accepted. The three ``shm_*`` fields come
  together, only to a hello that said ``shm`` and only from a trainer that maps pools: where
  to offer the pool, the token that ties the offer to this connection, its slot count.
  ``start``, ``skip`` (together, only to a hello that named its shard, only from a trainer
  that books positions: ``--save``): the shard's first batch to send and ``[first, last]``
  ranges above it not to send (trained, or in flight), at most ``MAX_RANGES`` of them
  (``resume_of_welcome`` checks them).
  ``pass``, ``pass_start``, ``pass_count`` (together, only to a hello that said ``passes``): the
  pass to make now, the ``seq`` it starts at, and how many passes the trainer trains.
  ``confirm`` (true; only to a hello that said it, only with ``start``): this trainer will
  send ``saved`` once a checkpoint holds the whole shard.
- ``saved`` ``{"seq": int}``: (a welcome that said ``confirm``) a complete checkpoint holds
  every batch of this shard's stream, which ends at ``seq`` (the producer's ``end``): the
  producer may leave; until then it stays and rewinds if a later welcome moves its shard.
- ``next_pass`` ``{"pass": int}``: every shard ended the pass before and it was trained: make
  pass ``pass``. The producer's credit is 0 again; ``credit`` follows.
- ``refused`` ``{"reason": str, "detail": str}``: hello refused (schema mismatch, limits).
- ``credit``  ``{"n": int}``: the producer may send ``n`` more batches.
- ``dropped`` ``{"seq": int, "reason": str, "detail": str}``: a batch was refused, and why.
- ``release`` ``{"pool": str, "slot": int, "gen": int}``: TensorFlow is done with that slot
  generation of the producer's pool; it may be written again.
- ``ended`` ``{"seq": int}``: (a hello that said ``ack_end``) the trainer has read this
  connection's ``end {seq}``, so it has read every batch before it too. Only then does the
  producer close: a TCP connection closed while data the peer sent is still unread there is
  reset, and a reset discards what the closing side's kernel had not yet delivered: the last
  batches and the ``end`` of a producer whose trainer reads slowly. A trainer older than this
  refuses a hello with ``ack_end`` (``header_fields``): upgrade trainers first.
- ``bye``     ``{}``: the trainer is closing. ``finished`` (true; only to a connection welcomed
  with ``confirm``): its run is finished (its final checkpoint says so), so no trainer will
  resume it: a producer waiting for ``saved`` has nothing to wait for.

Decoding is zero-copy (``np.frombuffer`` over the received frame) and strict: every field is
type-checked, dtypes come from an allow-list, shape x itemsize must equal the frame size, and
nothing but ``ProtocolError`` leaves a decoder (no ``repr`` of peer data: bounded excerpts).
Only plain msgpack reads a header, with extension types refused: no pickle, no msgpack-numpy
decoder ever sees received bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.position import MAX_RANGES, MAX_SHARDS
from stagefeed.common.schema import (
    ALLOWED_DTYPES,
    MAX_ARRAYS,
    MAX_DIM,
    MAX_NAME_LEN,
    MAX_NDIM,
    Schema,
    bounds_problem,
)

PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 16384
MAX_DETAIL_LEN = 300
MAX_PRODUCER_NAME = 64
FROM_PRODUCER = frozenset(["hello", "batch", "shm_batch", "end", "ping", "end_pass", "leaving"])
FROM_TRAINER = frozenset(
    ["welcome", "refused", "credit", "dropped", "release", "bye", "next_pass", "saved", "ended"]
)
# Why a producer said ``end`` (its bye): values are stable, they label a metric.
END_OK = "ok"
END_SOURCE_ERROR = "source_error"
END_OTHER = "other"  # a reason this trainer does not know (a newer or a hostile peer)
END_REASONS = frozenset([END_OK, END_SOURCE_ERROR])
# Keys of each kind besides "v" and "t", with the Python types they must have.
_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"name": (str,), "schema": (dict, type(None))},
    "batch": {"seq": (int,), "arrays": (list,)},
    "shm_batch": {"seq": (int,), "desc": (dict,)},
    "end": {"seq": (int,)},
    "ping": {},
    "end_pass": {"seq": (int,), "pass": (int,)},
    "leaving": {},
    "next_pass": {"pass": (int,)},
    "welcome": {"schema": (dict,), "max_message": (int,), "credit": (int,)},
    "refused": {"reason": (str,), "detail": (str,)},
    "credit": {"n": (int,)},
    "dropped": {"seq": (int,), "reason": (str,), "detail": (str,)},
    "release": {"pool": (str,), "slot": (int,), "gen": (int,)},
    "bye": {},
    "saved": {"seq": (int,)},
    "ended": {"seq": (int,)},
}
# Optional keys of a kind, in groups: each group all or none (v2 stays strict: nothing else
# is accepted).
_OPTIONAL: dict[str, tuple[dict[str, tuple[type, ...]], ...]] = {
    "hello": ({"shm": (bool,)}, {"session": (str,)},
              {"shard": (int,), "shards": (int,), "seek": (bool,)}, {"passes": (bool,)},
              {"confirm": (bool,)}, {"ack_end": (bool,)},
              {"group_first": (int,), "group_shards": (int,)}, {"group_stride": (int,)},
              {"order_source": (str,), "order_records": (int,), "order_seed": (int,),
               "order_shuffle": (bool,)}),
    "end": ({"reason": (str,), "detail": (str,)}, {"bad": (int,), "bad_first": (str,)}),
    "welcome": ({"shm_socket": (str,), "shm_token": (str,), "shm_slots": (int,)},
                {"start": (int,), "skip": (list,)},
                {"pass": (int,), "pass_start": (int,), "pass_count": (int,)},
                {"confirm": (bool,)}),
    "bye": ({"finished": (bool,)},),
}
SESSION = re.compile(r"[0-9a-f]{32}")
_INT_RANGE = {
    "seq": (0, 2**63),
    "max_message": (1, 2**40),
    "credit": (0, 2**20),
    "n": (1, 2**20),
    "slot": (0, 4096),
    "gen": (1, 2**64),
    "shm_slots": (1, 4097),
    "shard": (0, MAX_SHARDS),
    "shards": (1, MAX_SHARDS + 1),
    "group_first": (0, MAX_SHARDS), "group_shards": (1, MAX_SHARDS + 1),
    "group_stride": (1, MAX_SHARDS + 1),
    "start": (0, 2**63),
    "pass": (0, 2**31),
    "pass_start": (0, 2**63),
    "pass_count": (1, 2**31),
    "bad": (1, 2**63),
    "order_records": (1, 2**53 + 1), "order_seed": (0, 2**63),  # common/data_order.py
}


@dataclasses.dataclass(frozen=True)
class Batch:
    """A decoded batch. ``arrays`` are read-only views over the received frames."""

    seq: int
    arrays: dict[str, np.ndarray]
    nbytes: int


def refuse_ext(code: int, data: bytes) -> Any:
    """msgpack's ``ext_hook``: no extension type is accepted from a peer (msgpack-numpy's
    included), so nothing received is ever turned into an object by type code."""
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _fields_problem(kind: str, keys: set[str]) -> str | None:
    """Why ``keys`` (besides "v" and "t") are not a ``kind`` message's, or None."""
    required = set(_FIELDS[kind])
    groups = [set(group) for group in _OPTIONAL.get(kind, ())]
    extra = keys - required - set().union(*groups)
    missing = required - keys
    partial = [group for group in groups if keys & group and keys & group != group]
    if not (extra or missing or partial):
        return None
    unexpected = sorted(excerpt(k) for k in extra)[:4]
    missing_text = sorted(missing.union(*(group - keys for group in partial)))
    return f"{kind}: unexpected {unexpected}, missing {missing_text}"


def encode_control(kind: str, **fields: Any) -> bytes:
    """One control message (every kind but ``batch``), checked against its field table."""
    problem = _fields_problem(kind, set(fields))
    if problem or kind == "batch":
        raise ValueError(f"{problem or kind}; expected {sorted(_FIELDS[kind])}")
    if "detail" in fields:
        fields["detail"] = fields["detail"][:MAX_DETAIL_LEN]
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": kind, **fields})


def encode_batch(seq: int, arrays: Sequence[tuple[str, np.ndarray]]) -> list[Any]:
    """Frames for one batch: the header bytes, then each array's buffer (no copy).

    Arrays must be C-contiguous and of an allowed dtype; the caller keeps them unmodified
    until ZeroMQ has sent them (see ``producer.channel``).
    """
    specs = []
    frames: list[Any] = []
    for name, array in arrays:
        if array.dtype.str not in ALLOWED_DTYPES:
            raise ValueError(f"array {name!r}: dtype {array.dtype} is not allowed on the wire")
        if not array.flags.c_contiguous:
            raise ValueError(f"array {name!r} must be C-contiguous")
        specs.append([name, array.dtype.str, list(array.shape)])
        frames.append(memoryview(array).cast("B") if array.nbytes else b"")
    header = msgpack.packb({"v": PROTOCOL_VERSION, "t": "batch", "seq": seq, "arrays": specs})
    return [header, *frames]


def decode_header(raw: Any, kinds: frozenset[str]) -> dict[str, Any]:
    """The header map of a message, its kind in ``kinds`` and every field well-typed."""
    view = memoryview(raw)
    if view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(DropReason.HEADER_SIZE, f"{view.nbytes} B > {MAX_HEADER_BYTES} B")
    try:
        header = msgpack.unpackb(
            view, raw=False, strict_map_key=True, ext_hook=refuse_ext, use_list=True
        )
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types; none may escape
        detail = f"{type(exc).__name__}: {str(exc)[:120]}"
        raise ProtocolError(DropReason.HEADER_NOT_MSGPACK, detail) from None
    if not isinstance(header, dict):
        raise ProtocolError(DropReason.HEADER_NOT_MAP, type(header).__name__)
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(DropReason.VERSION, f"version {excerpt(header.get('v'))}")
    kind = header.get("t")
    if not isinstance(kind, str) or kind not in kinds:
        raise ProtocolError(DropReason.KIND, f"message kind {excerpt(kind)}")
    problem = _fields_problem(kind, set(header) - {"v", "t"})
    if problem:
        raise ProtocolError(DropReason.HEADER_FIELDS, problem, kind)
    fields = dict(_FIELDS[kind])
    for group in _OPTIONAL.get(kind, ()):
        fields.update(group)
    for key, types in fields.items():
        if key not in header:
            continue
        value = header[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError(DropReason.HEADER_FIELDS, f"{kind}.{key}: {excerpt(value)}", kind)
        if key in _INT_RANGE and not _INT_RANGE[key][0] <= value < _INT_RANGE[key][1]:
            raise ProtocolError(DropReason.HEADER_FIELDS, f"{kind}.{key}: {excerpt(value)}", kind)
        if isinstance(value, str) and len(value) > MAX_DETAIL_LEN:
            raise ProtocolError(
                DropReason.HEADER_FIELDS, f"{kind}.{key}: {len(value)} characters", kind
            )
    return header


def decode_batch(header: Mapping[str, Any], frames: Sequence[Any]) -> Batch:
    """The arrays of a ``batch`` message whose ``header`` is decoded; frames 1.. are the data.

    ``frames`` are buffer-protocol objects (``zmq.Frame``, ``bytes``); the arrays alias them.
    """
    declared = header["arrays"]
    if not 0 < len(declared) <= MAX_ARRAYS:
        raise ProtocolError(DropReason.PARTS, f"header declares {len(declared)} arrays")
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
                f"array {name!r}: shape {list(shape)} x {dtype.itemsize} B = {expected} B, "
                f"frame has {view.nbytes} B",
            )
        arrays[name] = np.frombuffer(view, dtype=dtype).reshape(shape)
        total += view.nbytes
    return Batch(header["seq"], arrays, total)


def check_against_schema(batch: Batch, schema: Schema) -> None:
    """Raise ``ProtocolError`` unless ``batch`` is exactly what the trainer's schema says."""
    if list(batch.arrays) != list(schema.names):
        raise ProtocolError(
            DropReason.SPEC_MISMATCH,
            f"arrays {list(batch.arrays)}, expected {list(schema.names)}",
        )
    for spec in schema.arrays:
        array = batch.arrays[spec.name]
        shape = schema.batch_shape(spec)
        if array.dtype != spec.np_dtype or array.shape != shape:
            raise ProtocolError(
                DropReason.SPEC_MISMATCH,
                f"{spec.name}: {array.dtype}{list(array.shape)}, "
                f"expected {spec.dtype}{list(shape)}",
            )
        problem = bounds_problem(spec, array)
        if problem:
            raise ProtocolError(DropReason.VALUE_RANGE, problem)


def schema_of_hello(header: Mapping[str, Any]) -> Schema | None:
    """The schema a hello declares (``None``: it asks for the trainer's); ``ProtocolError`` if
    the declaration is malformed.
    """
    from stagefeed.common.errors import ConfigError

    declared = header["schema"]
    if declared is None:
        return None
    try:
        return Schema.from_dict(declared, source="hello schema")
    except ConfigError as exc:
        raise ProtocolError(DropReason.HELLO, str(exc)[:MAX_DETAIL_LEN], "hello") from None


def one_line(text: str, limit: int = MAX_DETAIL_LEN) -> str:
    """Text (an error's, or a peer's detail) as one printable line of at most ``limit``
    characters: what a log line or a summary may quote of it."""
    return "".join(c if c.isprintable() else " " for c in text[:limit])


def end_reason(header: Mapping[str, Any]) -> tuple[str, str]:
    """``(reason, detail)`` of a decoded ``end``: ``ok`` without a reason, ``other`` for one
    not in ``END_REASONS``; the detail sanitised (``one_line``)."""
    reason = header.get("reason", END_OK)
    return (reason if reason in END_REASONS else END_OTHER), one_line(header.get("detail", ""))


def end_bad(header: Mapping[str, Any]) -> tuple[int, str]:
    """``(bad records skipped, the first named)`` of a decoded ``end``; ``(0, "")`` without."""
    return header.get("bad", 0), one_line(header.get("bad_first", ""))


def shard_of_hello(header: Mapping[str, Any]) -> tuple[int, int, bool] | None:
    """``(shard, shards, seek)`` of a hello that named its shard, else None."""
    if "shard" not in header:
        return None
    return header["shard"], header["shards"], header["seek"]


def group_of_hello(header: Mapping[str, Any]) -> range | None:
    """The shards of the hello's ``produce`` command (``group_first``, ``group_shards``,
    ``group_stride``), else None. Whether the hello's own shard is among them is the trainer's
    check."""
    if "group_first" not in header:
        return None
    first, stride = header["group_first"], header.get("group_stride", 1)
    return range(first, first + header["group_shards"] * stride, stride)


def passes_of_welcome(header: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """``(pass, pass_start, pass_count)`` of a welcome to a hello that said ``passes``, else
    None; ``ProtocolError`` if the pass is past ``pass_count``."""
    if "pass" not in header:
        return None
    if header["pass"] > header["pass_count"]:
        raise ProtocolError(DropReason.HEADER_FIELDS, "welcome.pass past pass_count", "welcome")
    return header["pass"], header["pass_start"], header["pass_count"]


def resume_of_welcome(header: Mapping[str, Any]) -> tuple[int, list[list[int]]] | None:
    """``(start, skip)`` of a welcome that carries them (None: no position); ``ProtocolError``
    if ``skip`` is not at most ``MAX_RANGES`` ascending ``[first, last]`` ranges past
    ``start``."""
    if "start" not in header:
        return None
    start, skip = header["start"], header["skip"]
    last = start
    ok = len(skip) <= MAX_RANGES
    for run in skip if ok else ():
        ok = (
            isinstance(run, list) and len(run) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in run)
            and last < run[0] <= run[1] < 2**63
        )  # fmt: skip
        if not ok:
            break
        last = run[1]
    if not ok:
        raise ProtocolError(DropReason.HEADER_FIELDS, f"welcome.skip: {excerpt(skip)}", "welcome")
    return start, skip


def check_producer_name(name: str) -> str:
    """A producer's self-declared name, for logs and the books; never an identity."""
    if not 0 < len(name) <= MAX_PRODUCER_NAME or not name.isprintable():
        raise ProtocolError(DropReason.HELLO, f"producer name {excerpt(name)}", "hello")
    return name


def check_session(header: Mapping[str, Any]) -> str | None:
    """A hello's session token (None if it sent none); ``ProtocolError`` if malformed."""
    session = header.get("session")
    if session is not None and not SESSION.fullmatch(session):
        raise ProtocolError(DropReason.HELLO, f"session {excerpt(session, 40)}", "hello")
    return session


def _check_array_entry(entry: Any) -> tuple[str, np.dtype, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise ProtocolError(DropReason.HEADER_FIELDS, f"array entry {excerpt(entry)}")
    name, dtype_str, shape = entry
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise ProtocolError(DropReason.HEADER_FIELDS, f"array name {excerpt(name)}")
    # Checked against the allow-list *before* numpy parses it.
    if not isinstance(dtype_str, str) or dtype_str not in ALLOWED_DTYPES:
        raise ProtocolError(DropReason.DTYPE, f"{excerpt(name)}: dtype {excerpt(dtype_str)}")
    if (
        not isinstance(shape, list)
        or not 0 < len(shape) <= MAX_NDIM + 1
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_DIM
                   for d in shape)
    ):
        raise ProtocolError(DropReason.SHAPE, f"{excerpt(name)}: shape {excerpt(shape)}")
    return name, np.dtype(dtype_str), tuple(shape)
