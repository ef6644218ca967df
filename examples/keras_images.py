"""A small Keras CNN on 64x64x3 uint8 images, 10 classes, trained with ``model.fit`` from a feed.

The images travel as uint8 (a quarter of float32's bytes); the schema declares the cast and
scale, and the model's first layer (``cast_layer``) applies them inside the step, on the
training device. The user's own generator stands in for producer processes.

    python -m examples.keras_images

The same model and data from the command line, with real producer processes::

    stagefeed run --schema examples.keras_images:SCHEMA --model examples.keras_images:build \
        --source examples.keras_images:batches --epochs 3 --steps-per-epoch 20 --save out/
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import keras
import numpy as np

from examples.filler import ThreadFiller
from stagefeed import ArraySpec, Feed, Schema, cast_layer

log = logging.getLogger(__name__)

CLASSES = 10
SCHEMA = Schema(
    (
        ArraySpec("images", "uint8", (64, 64, 3), cast="float32", scale=1 / 255),
        ArraySpec("labels", "int32", (), bounds=(0, CLASSES)),
    ),
    batch_size=16,
)


def user_batches(schema: Schema = SCHEMA, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Endless labelled batches: each class has its own colour, under uniform noise."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(40, 216, size=(CLASSES, 3))
    shape = schema.batch_shape(schema["images"])
    while True:
        labels = rng.integers(0, CLASSES, size=schema.batch_size).astype(np.int32)
        noise = rng.integers(-40, 40, size=shape)
        images = np.clip(palette[labels][:, None, None, :] + noise, 0, 255).astype(np.uint8)
        yield {"images": images, "labels": labels}


def batches(schema: Schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The same batches as the producers' source: ``--source examples.keras_images:batches``.

    Every worker uses one palette (the classes must look alike across workers); the noise
    differs per worker.
    """
    del worker  # one stream per worker would need the palette apart from the noise
    return user_batches(schema, seed=0)


def build_model(feed: Feed) -> keras.Model:
    """uint8 images in (as on the wire); cast and scale as the first layer of the model."""
    return build(feed.schema)


def build(schema: Schema) -> keras.Model:
    """The same model for the command line: ``--model examples.keras_images:build``.

    Its input is named after the array it takes (``images``) and has its wire dtype, so the
    feed hands it uint8 and the model casts; the other array, ``labels``, is the target.
    """
    images = schema["images"]
    inputs = keras.Input(images.shape, dtype=images.dtype, name="images")
    x = cast_layer(images)(inputs)
    x = keras.layers.Conv2D(8, 3, strides=2, activation="relu")(x)
    x = keras.layers.Conv2D(16, 3, strides=2, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(schema["labels"].bounds[1])(x)
    model = keras.Model(inputs, outputs, name="small_cnn")
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@dataclasses.dataclass
class Trained:
    model: keras.Model
    history: dict[str, list[float]]
    feed: Feed  # closed; ask it for the books


def train(steps_per_epoch: int = 8, epochs: int = 3, seed: int = 0) -> Trained:
    """Train from an endless source, then close the feed; returns the model and the books."""
    feed = Feed(SCHEMA, capacity=8, stage_depth=2)
    with ThreadFiller(feed, user_batches(seed=seed)):
        model = build_model(feed)
        history = model.fit(
            feed.dataset(("images", "labels"), cast="step"),
            steps_per_epoch=steps_per_epoch,
            epochs=epochs,
            callbacks=[feed.callback()],
            shuffle=False,  # a stream: producers decide the order
            verbose=0,
        )
    return Trained(model, history.history, feed)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = train()
    log.info("loss by epoch: %s", [round(v, 3) for v in result.history["loss"]])
    log.info("books: %s", result.feed.figures())


if __name__ == "__main__":
    main()
