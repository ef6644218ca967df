"""The TF 2 feed's dataset: queue order, cast/scale, Keras mappings, end of data."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from examples.filler import ThreadFiller
from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.tf2.feed import Feed

SCHEMA = Schema(
    (
        ArraySpec("images", "uint8", (4, 4, 1), cast="float32", scale=1 / 255),
        ArraySpec("labels", "int32", (), bounds=(0, 3)),
        ArraySpec("weights", "float32", ()),
    ),
    2,
)


def batch(seq: int) -> dict[str, np.ndarray]:
    images = (np.arange(32, dtype=np.uint8).reshape(2, 4, 4, 1) + seq * 7).astype(np.uint8)
    return {
        "images": images,
        "labels": np.array([seq % 3, (seq + 1) % 3], np.int32),
        "weights": np.full(2, seq, np.float32),
    }


def filled(count: int, **options) -> Feed:
    feed = Feed(SCHEMA, count, **options)
    for seq in range(count):
        assert feed.enqueue(batch(seq), peer=1, seq=seq)
    feed.close()
    return feed


def test_elements_are_dicts_in_queue_order_cast_and_scaled_then_the_dataset_ends():
    feed = filled(3)
    got = list(feed.dataset())
    assert len(got) == 3
    for seq, element in enumerate(got):
        assert set(element) == {"images", "labels", "weights"}
        assert element["images"].dtype == tf.float32
        expected = batch(seq)["images"].astype(np.float32) * np.float32(1 / 255)
        np.testing.assert_array_equal(element["images"].numpy(), expected)
        np.testing.assert_array_equal(element["labels"].numpy(), batch(seq)["labels"])
    figures = feed.figures()
    assert (figures.enqueued, figures.in_queue) == (3, 0)


def test_keras_mappings_give_tuples_nested_dicts_or_what_a_callable_returns():
    x, y, w = next(iter(filled(1).dataset(("images", "labels", "weights"))))
    assert x.shape == (2, 4, 4, 1) and y.dtype == tf.int32 and w.dtype == tf.float32
    inputs, target = next(iter(filled(1).dataset((["images", "weights"], "labels"))))
    assert set(inputs) == {"images", "weights"} and target.shape == (2,)
    (total,) = list(filled(1).dataset(lambda b: tf.reduce_sum(b["weights"])))
    assert float(total) == 0.0


@pytest.mark.parametrize(
    "mapping, message",
    [
        (("images", "nope"), "'nope'"),
        ((["images", 3], "labels"), "names 3"),
        ("images", "mapping must be"),
        ((), "mapping must be"),
    ],
)
def test_a_bad_mapping_is_a_config_error_naming_it(mapping, message):
    with pytest.raises(ConfigError, match=message):
        Feed(SCHEMA, 1).dataset(mapping)


def test_cast_in_the_step_leaves_wire_dtypes_for_the_feed_cast_or_the_keras_layer():
    feed = filled(1)
    element = next(iter(feed.dataset(cast="step")))
    assert element["images"].dtype == tf.uint8
    cast = feed.cast({"images": element["images"]})["images"]
    np.testing.assert_array_equal(
        cast.numpy(), batch(0)["images"].astype(np.float32) * np.float32(1 / 255)
    )
    layer_out = feed.cast_layer("images")(element["images"])
    np.testing.assert_allclose(np.asarray(layer_out), cast.numpy(), rtol=1e-6)
    with pytest.raises(ConfigError, match="already called"):
        feed.dataset()


def test_a_dataset_waiting_on_an_empty_queue_ends_when_the_feed_closes():
    feed = Feed(SCHEMA, 2, stage_depth=1)
    feed.enqueue(batch(0), 0, 0)
    iterator = iter(feed.dataset())
    next(iterator)
    closer = threading.Timer(0.3, feed.close)
    closer.start()
    began = time.monotonic()
    assert list(iterator) == []
    assert time.monotonic() - began >= 0.25
    closer.join(5)
    figures = feed.figures()
    assert (figures.enqueued, figures.in_queue, figures.unaccounted) == (1, 0, 0)


def test_bad_stage_depth_cast_and_names_are_config_errors():
    with pytest.raises(ConfigError, match="stage_depth"):
        Feed(SCHEMA, 1, stage_depth=0)
    with pytest.raises(ConfigError, match="cast"):
        Feed(SCHEMA, 1).dataset(cast="device")
    with pytest.raises(ConfigError, match="no array 'pixels'"):
        Feed(SCHEMA, 1).cast_layer("pixels")


def test_an_iterator_that_lived_long_is_dropped_at_once_after_the_end():
    """A stop drops the iterator after its last step: that must not wait for tf.data's autotune
    thread, which sleeps out its optimization period (doubling from 10 ms: 10.24 s from about
    10 s of life on) before a dropped iterator is gone. Measured without ``pipeline.build``'s
    options on its outer root: 6.8 s to drop after 14 s of life."""
    feed = Feed(SCHEMA, 64)
    dataset = feed.dataset()
    # What its iterator's root reads: the thread's switch (the drop below catches a wait only
    # when it falls in a long period: 1 of 2 runs without the options, measured)
    assert dataset.options().autotune.enabled is False

    def slowly():  # a slow producer: a batch every 0.25 s for 15 s, then the end of its data
        for seq in range(60):
            time.sleep(0.25)
            yield batch(seq % 30)

    filler = ThreadFiller(feed, slowly(), peer=1).start()
    iterator = iter(dataset)
    count = sum(1 for _ in iterator)
    filler.join()
    started = time.monotonic()
    del iterator
    dropped_s = time.monotonic() - started
    assert count == feed.figures().enqueued == 60
    assert dropped_s < 2.0, f"the iterator took {dropped_s:.1f} s to drop"
