"""Batches that get past the header with arrays the trainer does not take: a disallowed dtype
(and a msgpack-numpy pickle, never unpickled), a shape its frame disagrees with, bad
dimensions, values out of bounds, another schema, too many arrays, bad or duplicate names and
malformed array entries. Each is sent against credit and gets a ``dropped`` verdict."""

from __future__ import annotations

import numpy as np
import pytest

from stagefeed.common.schema import MAX_ARRAYS, MAX_NAME_LEN
from tests.hostile import wire
from tests.hostile_input.harness import H, W, check_cases, one

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess


# -- batches that get past the header (sent against credit, a verdict back) -------------------


def test_disallowed_dtype(target):
    dtypes = ["|O", "<c8", "|V8", "<U1", ">f4", "|S4", "<M8[s]", "float32", "", 4, None]
    check_cases(target, [
        one(repr(d), wire.images_declared(d, frame=b"\0" * 16), "dtype", credit=True)
        for d in dtypes
    ])  # fmt: skip


def test_msgpack_numpy_pickle_is_never_unpickled(target, tmp_path):
    # Positive control: msgpack-numpy's own decoder runs the pickle and creates the file.
    control = tmp_path / "control-created"
    wire.msgpack_numpy_decodes(wire.msgpack_numpy_payload(control))
    assert control.exists()

    marker = tmp_path / "trainer-must-not-create"
    payload = wire.msgpack_numpy_payload(marker)
    check_cases(target, [
        one("as-header", W(payload), "version"),  # a map, with no "v"
        one("object-images", wire.images_declared("|O", [1], payload), "dtype", credit=True),
        one("labels-frame", W(H(), label_bytes=payload), "frame_size", credit=True),
    ])  # fmt: skip
    assert not marker.exists(), "the trainer unpickled received bytes"


def test_shape_and_frame_size_disagree(target):
    nbytes = wire.images().nbytes
    check_cases(target, [
        one("one-byte-short", W(H(), bytes(nbytes - 1)), "frame_size", credit=True),
        one("four-bytes-long", W(H(), bytes(nbytes + 4)), "frame_size", credit=True),
        one("empty-frame", W(H(), b""), "frame_size", credit=True),
        # Every dimension allowed, their product ~2**124 bytes: compared, never allocated.
        one("huge-declared-small-frame",
            wire.images_declared("<f4", [2**31 - 1] * 4, frame=b"\0" * 16),
            "frame_size", credit=True),
    ])  # fmt: skip


def test_negative_zero_or_huge_dimensions(target):
    shapes = {
        "negative": [-2, 227, 227, 3],
        "zero": [0, 227, 227, 3],
        "huge": [2**40, 227, 227, 3],
        "2**31": [2**31, 1],
        "ten-dims": [1] * 10,
        "no-dims": [],
        "float-dim": [2.0, 227, 227, 3],
        "bool-dim": [True, 227, 227, 3],
        "a-string": "2x227",
        "a-map": {"0": 2},
    }
    check_cases(target, [
        one(k, wire.images_declared("<f4", s, frame=b"\0" * 16), "shape", credit=True)
        for k, s in shapes.items()
    ])  # fmt: skip


def test_value_outside_the_declared_bounds(target):
    values = {
        "negative": (0, -1),
        "num-classes": (wire.NUM_CLASSES, 0),
        "int32-extremes": (np.iinfo(np.int32).min, np.iinfo(np.int32).max),
    }
    check_cases(target, [
        one(k, W(H(), label_bytes=wire.labels(v).tobytes()), "value_range", credit=True)
        for k, v in values.items()
    ])  # fmt: skip


def test_well_formed_but_not_the_trainers_schema(target):
    img, lab = wire.IMAGE_SHAPE, [2]
    variants = {
        "size": [["images", "<f4", [2, 100, 100, 3]], ["labels", "<i4", lab]],
        "uint8": [["images", "|u1", img], ["labels", "<i4", lab]],
        "batch-size": [["images", "<f4", [3, 227, 227, 3]], ["labels", "<i4", [3]]],
        "label-dtype": [["images", "<f4", img], ["labels", "<i8", lab]],
        "name-not-in-schema": [["pixels", "<f4", img], ["labels", "<i4", lab]],
        "order": [["labels", "<i4", lab], ["images", "<f4", img]],
        "labels-absent": [["images", "<f4", img]],
        "extra-array": [["images", "<f4", img], ["labels", "<i4", lab], ["extra", "<i4", lab]],
    }
    cases = []
    for key, arrays in variants.items():
        data = [bytes(int(np.prod(s)) * np.dtype(d).itemsize) for _, d, s in arrays]
        cases.append(one(key, [H(arrays=arrays), *data], "spec_mismatch", credit=True))
    check_cases(target, cases)


def test_more_arrays_than_allowed(target):
    arrays = [[f"a{i}", "|u1", [1]] for i in range(MAX_ARRAYS + 1)]
    check_cases(target, [
        # As many frames as declared: over 1 + MAX_ARRAYS frames, dropped while receiving.
        one("frames-too", [H(arrays=arrays)] + [b"\0"] * len(arrays), "parts"),
        # Two frames only: the header's own count is refused.
        one("two-frames", [H(arrays=arrays), b"\0", b"\0"], "parts", credit=True),
        one("none-declared", [H(arrays=[]), b"\0"], "parts", credit=True),
    ])  # fmt: skip


def test_array_name_over_the_limit_or_not_a_string(target):
    names = {"65-chars": "x" * (MAX_NAME_LEN + 1), "empty": "", "int": 7, "nil": None,
             "list": ["images"], "bytes": b"images"}  # fmt: skip
    cases = [
        one(k, W(H(arrays=[[n, "<f4", wire.IMAGE_SHAPE], ["labels", "<i4", [2]]])),
            "header_fields", credit=True)
        for k, n in names.items()
    ]  # fmt: skip
    huge = H(arrays=[["x" * 20_000, "<f4", wire.IMAGE_SHAPE], ["labels", "<i4", [2]]])
    cases.append(one("20k-chars", W(huge), "header_size"))
    check_cases(target, cases)


def test_duplicate_array_names(target):
    img = wire.images().tobytes()
    arrays = [["images", "<f4", wire.IMAGE_SHAPE], ["images", "<f4", wire.IMAGE_SHAPE]]
    check_cases(target, [one("images-twice", [H(arrays=arrays), img, img], "header_fields",
                             credit=True)])  # fmt: skip


def test_array_entry_malformed(target):
    entries = {"two-items": ["images", "<f4"], "four-items": ["images", "<f4", [1], 0],
               "a-map": {"name": "images"}, "a-string": "images"}  # fmt: skip
    check_cases(target, [
        one(k, W(H(arrays=[e, ["labels", "<i4", [2]]])), "header_fields", credit=True)
        for k, e in entries.items()
    ])  # fmt: skip
