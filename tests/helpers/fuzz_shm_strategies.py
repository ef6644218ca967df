"""Hypothesis strategies for what the trainer takes besides batches: shared-memory slot
descriptors, pool announces and ``end`` messages, right or bent field by field (values nested
past Python's recursion limit, oversized, mistyped, fields missing or extra).

Deep values are ``Deep`` recipes, so a failing example prints in one line; ``built()`` makes
the structure a receiver would hold, ``packed_with_deep()`` the bytes a peer would send.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgpack
from hypothesis import strategies as st

from stagefeed.common import protocol
from stagefeed.common.schema import MAX_ARRAYS
from tests.helpers.fuzz_strategies import (
    INTS,
    LEAVES,
    dtype_strs,
    names,
    pack,
    shapes,
    small_dims,
    values,
)


@dataclasses.dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` deep (lists, or single-key maps) around ``leaf``, kept as a
    recipe: Hypothesis prints it in one line (the structure itself would not print), and it
    packs to raw bytes deeper than msgpack's packer nests. ``built()`` makes the structure."""

    depth: int
    leaf: Any
    as_map: bool

    def build(self) -> Any:
        value = self.leaf
        for _ in range(self.depth):
            value = {"a": value} if self.as_map else [value]
        return value

    def packed(self) -> bytes:
        wrapper = b"\x81" + msgpack.packb("a") if self.as_map else b"\x91"
        return wrapper * self.depth + pack(self.leaf)


@st.composite
def deep_values(draw) -> Deep:
    """A value nested 1..1100 deep, often past Python's recursion limit of 1000 (Hypothesis
    favours small integers)."""
    depth = draw(st.one_of(st.integers(1, 1100), st.integers(990, 1100)))
    return Deep(depth, draw(LEAVES), draw(st.booleans()))


def built(value: Any, levels: int = 3) -> Any:
    """``value`` with each ``Deep`` in its first ``levels`` levels built: what a receiver
    holds after unpacking it."""
    if isinstance(value, Deep):
        return value.build()
    if levels and isinstance(value, dict):
        return {k: built(v, levels - 1) for k, v in value.items()}
    if levels and isinstance(value, list):
        return [built(v, levels - 1) for v in value]
    return value


bent = st.one_of(
    values,
    deep_values(),
    deep_values(),
    st.text(min_size=100, max_size=8000),
    st.binary(min_size=100, max_size=8000),
    INTS,
    st.floats(),
    st.booleans(),
)
POOL_IDS = st.from_regex(r"[A-Za-z0-9._:@-]{1,64}", fullmatch=True)


@st.composite
def bent_map(draw, right: dict) -> dict:
    """A map of ``right``'s keys, each value drawn from its strategy (mostly) or ``bent``,
    some keys missing, up to two extra."""
    out = {}
    for key, strategy in right.items():
        if draw(st.integers(0, 9)) > 0:
            out[key] = draw(st.one_of(strategy, strategy, bent))
    for _ in range(draw(st.integers(0, 2))):
        out[draw(st.one_of(st.sampled_from(sorted(right) + ["x"]), st.text(max_size=8)))] = draw(
            bent
        )
    return out


def descriptor_maps():
    """Slot descriptors (``{"pool", "slot", "gen", "seq"}``), right or bent field by field."""
    return bent_map({
        "pool": POOL_IDS, "slot": st.integers(0, 4096), "gen": st.integers(1, 2**64 - 1),
        "seq": st.integers(0, 2**64 - 1),
    })  # fmt: skip


descriptors = st.one_of(descriptor_maps(), descriptor_maps(), bent)
layout_entries = st.one_of(
    st.tuples(names, dtype_strs, st.one_of(small_dims, shapes, deep_values())).map(list), bent
)
announces = st.one_of(
    bent_map({
        "v": st.just(1), "pool": POOL_IDS, "slots": st.integers(1, 4096),
        "layout": st.one_of(st.lists(layout_entries, max_size=MAX_ARRAYS + 2), bent),
    }),
    bent,
)  # fmt: skip


def packed_with_deep(value: Any, levels: int = 3) -> bytes:
    """msgpack of ``value``, each ``Deep`` in its first ``levels`` levels written as its raw
    nested bytes (deeper than msgpack's packer goes)."""
    if isinstance(value, Deep):
        return value.packed()
    if levels and isinstance(value, dict) and len(value) < 2**16:
        head = bytes([0x80 | len(value)]) if len(value) < 16 else b"\xde" + struct.pack(
            ">H", len(value)
        )
        return head + b"".join(pack(k) + packed_with_deep(v, levels - 1) for k, v in value.items())
    if levels and isinstance(value, list) and len(value) < 2**16:
        head = bytes([0x90 | len(value)]) if len(value) < 16 else b"\xdc" + struct.pack(
            ">H", len(value)
        )
        return head + b"".join(packed_with_deep(v, levels - 1) for v in value)
    return pack(value)


@st.composite
def shm_batch_headers(draw, seq: int) -> bytes:
    """A ``shm_batch`` header of ``seq`` whose ``desc`` is a map, right or bent: it decodes as
    a shm_batch, so it takes a credit and must get a verdict."""
    header = {"v": protocol.PROTOCOL_VERSION, "t": "shm_batch", "seq": seq}
    return packed_with_deep({**header, "desc": draw(descriptor_maps())})


@st.composite
def end_headers(draw) -> bytes:
    """An ``end`` header whose ``seq`` is right, nested, oversized or mistyped, maybe with a
    reason and detail (any text, or bent), half of them, or an extra field."""
    fields = {"v": protocol.PROTOCOL_VERSION, "t": "end",
              "seq": draw(st.one_of(st.integers(0, 2**63 - 1), bent))}  # fmt: skip
    for key in draw(st.sampled_from([(), ("reason", "detail"), ("reason",), ("detail",)])):
        fields[key] = draw(st.one_of(st.sampled_from(["ok", "source_error"]), st.text(), bent))
    if draw(st.integers(0, 4)) == 0:
        fields[draw(st.sampled_from(["x", "seq2", "desc"]))] = draw(bent)
    return packed_with_deep(fields)
