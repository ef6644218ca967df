"""Producer sources: the contract's two forms, sharding, checks, and the synthetic source."""

from __future__ import annotations

import numpy as np
import pytest

from stagefeed.common.errors import BrokenError, ConfigError
from stagefeed.common.schema import ArraySpec, Schema, SchemaMismatch, image_schema
from stagefeed.producer.buffers import ALIGN
from stagefeed.producer.sources import (
    FillingStream,
    IterableStream,
    WorkerInfo,
    open_stream,
    resolve_source,
)

THREE = Schema(
    (
        ArraySpec("features", "float32", (32,)),
        ArraySpec("token_ids", "int64", (20,), bounds=(0, 30000)),
        ArraySpec("targets", "float32"),
    ),
    batch_size=8,
)


def worker(index: int = 0, count: int = 1, seed: int = 0) -> WorkerInfo:
    return WorkerInfo(index=index, count=count, producer_id=f"test-{index}", seed=seed)


def drain(stream, limit: int = 100):
    """Batches of ``stream`` until its end, releasing each at once (as ZeroMQ would, later)."""
    out = []
    while len(out) < limit and (item := stream.next()) is not None:
        arrays, release = item
        out.append({k: v.copy() for k, v in arrays.items()})
        if release:
            release()
    return out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"index": 2, "count": 2}, r"index 2 is not in \[0, 2\)"),
        ({"index": -1}, "index -1"),
        ({"count": True}, "count must be an integer"),
        ({"producer_id": ""}, "producer_id"),
    ],
)
def test_worker_info_is_validated(kwargs, match):
    fields = {"index": 0, "count": 1, "producer_id": "p", "seed": 0, **kwargs}
    with pytest.raises(ConfigError, match=match):
        WorkerInfo(**fields)


def test_workers_shard_disjointly_and_completely():
    schema = Schema((ArraySpec("x", "int32"),), batch_size=2)
    seen = []
    for index in range(3):
        stream = open_stream("tests.helpers.user_source:sharded", schema, worker(index, 3),
            pool_size=2)
        assert isinstance(stream, IterableStream)
        seen.append([int(b["x"][0]) for b in drain(stream)])
    assert seen == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_iterable_source_yields_checked_fresh_arrays():
    stream = open_stream("tests.helpers.user_source:batches", THREE, worker(index=3, count=4),
        pool_size=2)
    arrays, release = stream.next()
    assert release is None  # fresh arrays need no tracking
    assert list(arrays) == ["features", "token_ids", "targets"]
    assert (arrays["token_ids"] == 3).all() and arrays["token_ids"].dtype == np.int64


def test_filling_source_writes_into_aligned_pool_buffers_reused_only_after_release():
    stream = open_stream("tests.helpers.user_source:counting", THREE, worker(), pool_size=2)
    assert isinstance(stream, FillingStream)
    first, release_first = stream.next()
    second, release_second = stream.next()
    assert all(a.ctypes.data % ALIGN == 0 for a in [*first.values(), *second.values()])
    assert first["features"].ctypes.data != second["features"].ctypes.data
    assert (first["features"] == 0).all() and (second["features"] == 1).all()
    with pytest.raises(RuntimeError, match="exhausted"):
        stream.next()  # both slots are held: nothing may be filled
    release_first()
    third, _ = stream.next()
    assert third["features"].ctypes.data == first["features"].ctypes.data
    assert (third["features"] == 2).all() and (second["features"] == 1).all()


def test_filling_source_ends_when_fill_returns_false():
    stream = open_stream("tests.helpers.user_source:counting", THREE, worker(), pool_size=2)
    assert len(drain(stream)) == 24
    assert stream.pool.free == 2


def test_filling_source_must_not_replace_its_buffers():
    stream = open_stream("tests.helpers.user_source:replaces_buffers", THREE, worker(), pool_size=2)
    with pytest.raises(ConfigError, match=r"replaced features, token_ids, targets instead of"):
        stream.next()


def test_first_batch_mismatch_names_source_batch_array_expected_and_actual():
    stream = open_stream("tests.helpers.user_source:wrong_shape", THREE, worker(), pool_size=1)
    with pytest.raises(SchemaMismatch) as info:
        stream.next()
    assert str(info.value) == (
        "source 'tests.helpers.user_source:wrong_shape' batch 0: "
        "features is float32[1, 2, 3], expected float32[8, 32]"
    )


def test_a_short_last_batch_is_refused_by_name_or_dropped_when_asked():
    """Issue 20 item 1: a short last batch gets its own message naming the choice."""
    stream = open_stream("tests.helpers.user_source:short_last", THREE, worker(), pool_size=1)
    assert len(drain(stream, limit=2)) == 2
    with pytest.raises(SchemaMismatch) as info:
        stream.next()
    assert str(info.value) == (
        "source 'tests.helpers.user_source:short_last' batch 2 is short: 3 rows, the batch size "
            "is 8 "
        "(the end of data that does not divide by it?); pass --short-batch drop to drop "
        "short batches (like tf.data's drop_remainder)"
    )
    stream = open_stream(
        "tests.helpers.user_source:short_last", THREE, worker(), pool_size=1, short_batch="drop"
    )
    assert len(drain(stream, limit=5)) == 2 and stream.next() is None  # the short one dropped
    assert (stream.short_dropped, stream.short_rows_dropped) == (1, 3)


def test_values_outside_bounds_are_refused_on_any_batch():
    schema = Schema((ArraySpec("ids", "int64", (2,), bounds=(0, 5)),), batch_size=2)
    stream = open_stream("tests.helpers.user_source:sharded", schema, worker(), pool_size=1)
    assert len(drain(stream, limit=5)) == 5  # items 0..4 are inside [0, 5)
    allowed = r"batch 5: ids values span \[5, 5\], allowed \[0, 5\)"
    with pytest.raises(SchemaMismatch, match=allowed):
        stream.next()


def test_a_failing_user_source_is_one_line_naming_it():
    stream = open_stream("tests.helpers.user_source:fails", THREE, worker(), pool_size=1)
    stream.next()
    with pytest.raises(BrokenError,
        match=r"source 'tests.helpers.user_source:fails' failed at batch 1: "
                       r"KeyError: 'no such shard'"):
        stream.next()


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ("tests.nonexistent:f", r"--source 'tests.nonexistent:f' cannot be imported"),
        ("tests.helpers.user_source:nope", r"module 'tests.helpers.user_source' has no 'nope'"),
        ("tests.helpers.user_source:not_callable", r"is a int, not a function"),
    ],
)
def test_unloadable_source_fails_naming_it(ref, match):
    with pytest.raises(ConfigError, match=match):
        resolve_source(ref)


def test_synthetic_source_fills_any_schema_once_and_cycles_its_pool():
    stream = open_stream("synthetic", THREE, worker(seed=7), pool_size=3)
    batches = [stream.next() for _ in range(7)]
    assert all(release is None for _, release in batches)  # never rewritten: no tracking
    addresses = [arrays["features"].ctypes.data for arrays, _ in batches]
    assert addresses[:3] == addresses[3:6] and addresses[6] == addresses[0]
    assert len(set(addresses[:3])) == 3
    arrays = batches[0][0]
    assert arrays["features"].shape == (8, 32) and arrays["features"].dtype == np.float32
    assert arrays["features"].min() >= 0 and arrays["features"].max() < 1
    assert arrays["features"].std() > 0
    assert arrays["token_ids"].dtype == np.int64 and arrays["token_ids"].shape == (8, 20)
    assert arrays["token_ids"].min() >= 0 and arrays["token_ids"].max() < 30000
    assert arrays["token_ids"].max() >= 100  # drawn from the bounds, not the default range
    assert arrays["targets"].shape == (8,)
    again = open_stream("synthetic", THREE, worker(seed=7), pool_size=3).next()[0]
    other = open_stream("synthetic", THREE, worker(seed=8), pool_size=3).next()[0]
    np.testing.assert_array_equal(again["token_ids"], arrays["token_ids"])  # reproducible
    assert not np.array_equal(other["token_ids"], arrays["token_ids"])


def test_synthetic_defaults_for_unbounded_ints_bools_and_uint8_images():
    schema = Schema(
        (
            ArraySpec("n", "int16", (50,)),
            ArraySpec("mask", "bool", (50,)),
            ArraySpec("h", "float16", (50,)),
        ),
        batch_size=4,
    )
    arrays = open_stream("synthetic", schema, worker(), pool_size=1).next()[0]
    assert arrays["n"].min() >= 0 and arrays["n"].max() < 100
    assert arrays["mask"].any() and not arrays["mask"].all()
    assert arrays["h"].max() < 1
    images = open_stream("synthetic", image_schema(2, 8, "uint8", 10), worker(), 1).next()[0]
    assert images["labels"].max() < 10 and images["images"].dtype == np.uint8
