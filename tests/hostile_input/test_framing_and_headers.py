"""Messages dropped at the header, before any credit is used: garbage, the wrong number of
parts, a header that is not msgpack or not a map, an unknown version or kind, ill-typed,
missing or extra fields, an oversized header, and a header nested 1000 deep."""

from __future__ import annotations

import msgpack
import pytest

from tests.hostile import wire
from tests.hostile_input.harness import H, W, check_cases, check_still_training, new_peer, one

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

MAX_HEADER = 16384  # common/protocol.py MAX_HEADER_BYTES


# -- malformed headers (dropped before any credit is used) ------------------------------------


def test_garbage_bytes(target):
    check_cases(target, [
        one("three-frames", [wire.garbage(64), wire.garbage(1000), wire.garbage(10)],
            "header_not_msgpack"),
        one("one-frame", [wire.garbage(100)], "header_not_msgpack"),
    ])  # fmt: skip


def test_too_few_or_too_many_parts(target):
    check_cases(target, [
        one("header-only", [H()], "parts", credit=True),
        one("labels-missing", W(H())[:2], "parts", credit=True),
        one("one-extra", [*W(H()), b"x"], "parts", credit=True),
        # More than 1 + MAX_ARRAYS frames: dropped while receiving, before the header is read.
        one("twenty-frames", [H()] + [b"x"] * 20, "parts"),
    ])  # fmt: skip


def test_header_not_msgpack(target):
    heads = {
        "json": b'{"v": 2, "t": "batch", "seq": 0}',
        "truncated": H()[:-5],
        "trailing-byte": H() + b"\x00",
        "extension-type": msgpack.packb(msgpack.ExtType(1, b"ext")),
        "int-map-key": msgpack.packb({1: "int key"}),
        "nested-1100-deep": wire.nested_lists(1100),
        "garbage": wire.garbage(200),
    }
    check_cases(target, [one(k, W(h), "header_not_msgpack") for k, h in heads.items()])


def test_header_not_a_map(target):
    values = [[1, "x"], 7, "header", b"header", None, 1.5, True]
    check_cases(target, [one(repr(v), W(msgpack.packb(v)), "header_not_map") for v in values])


def test_unknown_protocol_version(target):
    versions = [1, 0, 3, "2", None, 2**40, True, [2], {"v": 2}]
    check_cases(target, [one(repr(v), W(H(v=v)), "version") for v in versions])


def test_kind_the_trainer_does_not_take(target):
    kinds = ["welcome", "dropped", "bye", "nope", "", 7, None]
    check_cases(target, [one(repr(k), W(H(t=k)), "kind") for k in kinds])


def test_ill_typed_missing_or_extra_fields(target):
    fields = {
        "seq-missing": {"seq": ...},
        "arrays-missing": {"arrays": ...},
        "seq-negative": {"seq": -1},
        "seq-2**63": {"seq": 2**63},
        "seq-bool": {"seq": True},
        "seq-float": {"seq": 1.0},
        "arrays-a-map": {"arrays": {"images": 1}},
        "extra-producer-field": {"producer": "someone-else"},
    }
    check_cases(target, [one(k, W(H(**f)), "header_fields") for k, f in fields.items()])


def test_oversized_header(target):
    arrays = [["images", "<f4", wire.IMAGE_SHAPE], ["labels", "<i4", [2]]] + [
        ["x" * 60, "<f4", [1]]
    ] * 300
    head = H(arrays=arrays)
    assert len(head) > MAX_HEADER
    check_cases(target, [
        one("300-arrays", W(head), "header_size"),
        one("16k-garbage", [wire.garbage(MAX_HEADER + 1)], "header_size"),
    ])  # fmt: skip


def test_header_nested_1000_deep(target):
    """v1: ``arrays`` nested 1000 lists deep made an error message ``repr()`` it; the receive
    thread died and the trainer exited 3 with no summary. Now: dropped, counted, trained on."""
    deep, maps = wire.nested_lists(1000), wire.nested_maps(1000)

    def head(field: str, value: bytes) -> bytes:
        fields = {"v": wire.V, "t": "batch", "seq": 0, "arrays": []}
        del fields[field]
        return wire.packed_map(fields, {field: value})

    check_cases(target, [
        one("arrays-one-frame", [head("arrays", deep), b"\0"], "header_fields", credit=True),
        one("arrays-two-frames", [head("arrays", deep), b"\0", b"\0"], "parts", credit=True),
        one("arrays-entry", [head("arrays", b"\x91" + wire.nested_lists(999)), b"\0"],
            "header_fields", credit=True),
        one("arrays-maps", [head("arrays", b"\x91" + wire.nested_maps(999)), b"\0"],
            "header_fields", credit=True),
        one("shape", [head("arrays", b"\x91\x93" + msgpack.packb("images") + msgpack.packb("<f4")
                           + wire.nested_lists(998)), b"\0"], "shape", credit=True),
        one("v", [head("v", deep)], "version"),
        one("t-maps", [head("t", maps)], "kind"),
        one("seq", [head("seq", deep)], "header_fields"),
        one("extra-field", [wire.packed_map({"v": wire.V, "t": "ping"}, {"x": maps})],
            "header_fields"),
    ])  # fmt: skip


# -- the producer's bye (``end`` with a reason) ------------------------------------------------


def _end(**fields) -> list[bytes]:
    return [msgpack.packb({"v": 2, "t": "end", "seq": 0, **fields})]


def test_a_hostile_bye_is_dropped_and_counted(target):
    """An ``end`` whose reason or detail is huge, not a string, or half there: dropped whole."""
    check_cases(target, [
        one("detail-huge", _end(reason="source_error", detail="x" * MAX_HEADER), "header_size"),
        one("detail-long", _end(reason="source_error", detail="x" * 301), "header_fields"),
        one("reason-int", _end(reason=7, detail="x"), "header_fields"),
        one("reason-nested", _end(reason=[[["source_error"]]], detail="x"), "header_fields"),
        one("detail-only", _end(detail="x"), "header_fields"),
    ])  # fmt: skip


def test_a_bye_of_an_unknown_reason_is_booked_other_and_sanitised(target):
    key = ("stagefeed_producers_ended_total", (("reason", "other"),))
    before = target.metrics().samples.get(key, 0)
    start = target.metrics()
    p = new_peer(target)
    p.send(_end(reason="\x1b[2Jpwned", detail="line\nbreak\x00"))
    after = target.wait(lambda m: m.samples.get(key, 0) > before)
    assert after.samples.get(key, 0) == before + 1
    assert after.dropped == start.dropped  # not a drop: an end, booked "other"
    check_still_training(target, start)
