"""scikit-learn's handwritten digits (``load_digits``: 1797 images of 8x8, shipped inside the
package) trained through stagefeed's built-in data sources, and the same model with plain
Keras on the same split, for comparison (docs/data.md).

From the command line, on ``.npy`` files (memory-mapped by the producers)::

    python -m examples.digits prepare data/digits          # the split, as .npy files
    stagefeed run --source npy:data/digits/pixels.npy,data/digits/labels.npy \
        --model examples.digits:build --targets labels --batch-size 32 --short-batch drop \
        --epochs 30 --save out/digits
    python -m examples.digits evaluate out/digits/model.keras data/digits
    python -m examples.digits keras data/digits              # plain Keras, same split

From Python: ``train`` below is a ``MapSource`` over the arrays in memory, named with
``--source examples.digits:train --schema examples.digits:SCHEMA``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import numpy as np

import stagefeed
from stagefeed import ArraySpec, Schema

log = logging.getLogger("examples.digits")

CLASSES = 10
SEED = 0
TEST_FRACTION = 0.2
SCHEMA = Schema(
    (ArraySpec("pixels", "float32", (64,)), ArraySpec("labels", "int32", bounds=(0, CLASSES))),
    batch_size=32,
)


def split() -> dict[str, np.ndarray]:
    """The digits, scaled to [0, 1], split into train and test with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(SEED).permutation(len(labels))
    test = int(len(labels) * TEST_FRACTION)
    return {
        "train_pixels": pixels[order[test:]], "train_labels": labels[order[test:]],
        "test_pixels": pixels[order[:test]], "test_labels": labels[order[:test]],
    }  # fmt: skip


def build(schema: Schema | None = None) -> Any:
    """A compiled Keras model: 64 pixels -> 10 logits (one hidden layer of 64)."""
    import keras

    pixels = keras.Input((64,), name="pixels")
    hidden = keras.layers.Dense(64, activation="relu")(pixels)
    logits = keras.layers.Dense(CLASSES)(hidden)
    model = keras.Model(pixels, logits, name="digits")
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _train_source() -> stagefeed.MapSource:
    data = split()
    records = stagefeed.ArrayRecords(
        {"pixels": data["train_pixels"], "labels": data["train_labels"]}, "digits train"
    )
    return stagefeed.MapSource(records, seed=SEED, short_batch="drop")


def __getattr__(name: str) -> Any:
    if name == "train":  # made on first use: scikit-learn is imported only then
        return _train_source()
    raise AttributeError(name)


def prepare(folder: str) -> None:
    """The train split as ``pixels.npy``/``labels.npy``, the test split as ``test_*.npy``."""
    os.makedirs(folder, exist_ok=True)
    data = split()
    np.save(os.path.join(folder, "pixels.npy"), data["train_pixels"])
    np.save(os.path.join(folder, "labels.npy"), data["train_labels"])
    np.save(os.path.join(folder, "test_pixels.npy"), data["test_pixels"])
    np.save(os.path.join(folder, "test_labels.npy"), data["test_labels"])
    log.info("%s: %d train, %d test records", folder, len(data["train_labels"]),
             len(data["test_labels"]))  # fmt: skip


def accuracy(model: Any, folder: str) -> float:
    pixels = np.load(os.path.join(folder, "test_pixels.npy"))
    labels = np.load(os.path.join(folder, "test_labels.npy"))
    predicted = np.argmax(model.predict(pixels, verbose=0), axis=1)
    return float(np.mean(predicted == labels))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m examples.digits")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("folder")
    evaluate = sub.add_parser("evaluate")
    evaluate.add_argument("model")
    evaluate.add_argument("folder")
    plain = sub.add_parser("keras")
    plain.add_argument("folder")
    plain.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.folder)
        return
    import keras

    if args.command == "evaluate":
        model = keras.models.load_model(args.model)
    else:
        keras.utils.set_random_seed(SEED)
        model = build()
        pixels = np.load(os.path.join(args.folder, "pixels.npy"))
        labels = np.load(os.path.join(args.folder, "labels.npy"))
        model.fit(pixels, labels, batch_size=SCHEMA.batch_size, epochs=args.epochs, verbose=0)
    log.info("test accuracy %.4f", accuracy(model, args.folder))


if __name__ == "__main__":
    main()
