"""``bench input``'s trainer side: the tiny model, and the three Keras-fed peers of stagefeed.

Each peer runs in a process of its own (``input_worker``) so TensorFlow's state (its thread
pools, a ``PyDataset``'s worker processes) never meets another mode's. It trains
``warmup_steps + steps`` batches with ``model.fit`` and times the ``steps`` after the warm-up
with a callback: images/s over that window, and the CPU its process tree used in it.

- ``tf.data``: ``tf.io.read_file`` + ``tf.io.decode_jpeg`` + random crop and flip in
  TensorFlow ops, ``map(num_parallel_calls=AUTOTUNE)``, ``batch``, ``prefetch``: the ceiling
  where a pipeline can be written in TensorFlow ops;
- ``from_generator``: ``Dataset.from_generator`` over the Python decode (``PythonDecode``);
- ``pydataset``: ``keras.utils.PyDataset(workers=N, use_multiprocessing=True)`` over it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any

from stagefeed.bench.cpu import tree_cpu_s
from stagefeed.bench.input_config import FROM_GENERATOR, PYDATASET, TF_DATA, InputConfig
from stagefeed.bench.input_data import CLASSES, PythonDecode
from stagefeed.common.logs import setup_logging
from stagefeed.common.schema import ArraySpec, Schema

log = logging.getLogger(__name__)

SUBSAMPLE = 8  # the model reads every 8th pixel each way: 1/64 of each image (``build``)


def input_schema(config: InputConfig) -> Schema:
    """What every mode trains on: uint8 crops cast to float32 and scaled by 1/255 in the model
    (the schema ``stagefeed run`` derives from the ``images:DIR`` source and the crop)."""
    images = ArraySpec(
        "images", "uint8", (config.crop, config.crop, 3), cast="float32", scale=1.0 / 255.0
    )
    labels = ArraySpec("labels", "int32", (), bounds=(0, len(CLASSES)))
    return Schema(arrays=(images, labels), batch_size=config.batch_size)


def build(schema: Schema) -> Any:
    """The model too small to matter: every ``SUBSAMPLE``-th pixel each way (a strided slice,
    which reads only those), the cast, global average pooling, one dense layer; every mode
    still hands it the whole batch. ``stagefeed run --model stagefeed.bench.input_keras:build``
    trains it too. Over every pixel it was not small: 6.5 ms of CPU a batch of 32 crops, half
    the stagefeed trainer's CPU (docs/benchmarks.md, 2026-12-05)."""
    import keras

    from stagefeed.consumer.keras_fit.callback import cast_layer

    images = schema["images"]
    inputs = keras.Input(images.shape, dtype=images.dtype, name="images")
    x = keras.layers.Lambda(
        lambda batch: batch[:, ::SUBSAMPLE, ::SUBSAMPLE, :], name="subsample"
    )(inputs)
    x = cast_layer(images)(x) if images.cast or images.scale else x
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    logits = keras.layers.Dense(schema["labels"].bounds[1], name="logits")(x)
    model = keras.Model(inputs, logits, name="tiny")
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def _clock(warmup: int, total: int) -> Any:
    """A Keras callback that notes the time and the process tree's CPU at the end of the last
    warm-up batch and of the last batch."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.marks: dict[str, tuple[float, float | None]] = {}

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch + 1 in (warmup, total):
                mark = "start" if batch + 1 == warmup else "end"
                self.marks[mark] = (time.perf_counter(), tree_cpu_s())

    return Clock()


def _tf_data(config: InputConfig, folder: str) -> Any:
    import tensorflow as tf

    decode = PythonDecode(folder, config.crop, config.seed)
    paths, labels = decode.images.paths, decode.images.labels
    crop = config.crop

    def load(path: Any, label: Any) -> tuple[Any, Any]:
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        image = tf.image.random_crop(image, (crop, crop, 3))
        return tf.image.random_flip_left_right(image), label

    return (
        tf.data.Dataset.from_tensor_slices((paths, labels))
        .shuffle(len(paths), seed=config.seed, reshuffle_each_iteration=True)
        .repeat()
        .map(load, num_parallel_calls=tf.data.AUTOTUNE)
        .batch(config.batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def _from_generator(config: InputConfig, folder: str) -> Any:
    import tensorflow as tf

    decode = PythonDecode(folder, config.crop, config.seed)
    signature = (
        tf.TensorSpec((config.crop, config.crop, 3), tf.uint8),
        tf.TensorSpec((), tf.int32),
    )
    return (
        tf.data.Dataset.from_generator(decode.samples, output_signature=signature)
        .batch(config.batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def _pydataset(config: InputConfig, folder: str, workers: int) -> Any:
    from stagefeed.bench.input_pydataset import DecodedBatches

    return DecodedBatches(
        folder, config.crop, config.seed, config.batch_size, config.total_steps, workers
    )


def measure(mode: str, workers: int, config: InputConfig, folder: str) -> dict[str, Any]:
    """Train ``config.total_steps`` batches of ``mode``; the timed window's figures."""
    schema = input_schema(config)
    model = build(schema)
    if mode == TF_DATA:
        data = _tf_data(config, folder)
    elif mode == FROM_GENERATOR:
        data = _from_generator(config, folder)
    elif mode == PYDATASET:
        data = _pydataset(config, folder, workers)
    else:
        raise ValueError(f"not a Keras-fed mode: {mode!r}")
    clock = _clock(config.warmup_steps, config.total_steps)
    steps = None if mode == PYDATASET else config.total_steps  # a PyDataset's length is its own
    model.fit(
        data, epochs=1, steps_per_epoch=steps, callbacks=[clock], shuffle=False, verbose=0
    )
    (start_s, start_cpu), (end_s, end_cpu) = clock.marks["start"], clock.marks["end"]
    seconds = end_s - start_s
    images = config.steps * config.batch_size
    cpu = None if start_cpu is None or end_cpu is None else end_cpu - start_cpu
    return {
        "seconds": seconds,
        "images": images,
        "cpu_s": cpu,
        "decoder": "tf.io.decode_jpeg" if mode == TF_DATA else PythonDecode(folder, 8).decoder,
        "start_method": multiprocessing.get_start_method() if mode == PYDATASET else None,
    }


def input_worker(
    mode: str, workers: int, config: InputConfig, folder: str, conn: Any, log_level: int,
    start_method: str,
) -> None:  # fmt: skip
    """Process entry point: ``("done", figures)`` or ``("error", text)`` on ``conn``. The
    coordinator owns shutdown: SIGINT is ignored here. ``start_method``: the coordinator's
    default, which a user's script would have (a spawned process has spawn's), for the
    processes a ``PyDataset`` starts."""
    setup_logging(log_level)
    multiprocessing.set_start_method(start_method, force=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from stagefeed.consumer.quiet_tf import import_tensorflow

        import_tensorflow()
        conn.send(("done", measure(mode, workers, config, folder)))
    except Exception as exc:  # noqa: BLE001 - sent to the coordinator, which raises it
        log.debug("mode %s failed", mode, exc_info=True)
        try:
            conn.send(("error", f"{mode}: {exc!r}\n{traceback.format_exc(limit=8)}"))
        except (BrokenPipeError, EOFError, OSError):
            pass
    finally:
        conn.close()
    logging.shutdown()  # flush, before the exit that skips finalization (bench.worker says why)
    os._exit(0)
