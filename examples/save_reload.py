"""Save the model trained by ``keras_images`` as ``.keras``, reload it, compare predictions.

The cast layer is a built-in ``Rescaling``, so the file reloads without custom objects, and the
reloaded model takes uint8 images exactly as they travel on the wire.

    python -m examples.save_reload [DIRECTORY]
"""

from __future__ import annotations

import dataclasses
import logging
import os

import keras
import numpy as np

from examples import keras_images, run_in_directory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Reloaded:
    path: str
    max_difference: float  # largest |before - after| over the check batch's logits
    equal: bool


def save_and_reload(directory: str, steps_per_epoch: int = 4, epochs: int = 1) -> Reloaded:
    """Train briefly, save to ``directory/small_cnn.keras``, reload, predict the same batch."""
    trained = keras_images.train(steps_per_epoch=steps_per_epoch, epochs=epochs)
    path = os.path.join(directory, "small_cnn.keras")
    trained.model.save(path)
    reloaded = keras.models.load_model(path)
    images = next(keras_images.user_batches(seed=1))["images"]
    before = np.asarray(trained.model.predict(images, verbose=0))
    after = np.asarray(reloaded.predict(images, verbose=0))
    difference = float(np.max(np.abs(before - after)))
    return Reloaded(path, difference, bool(np.array_equal(before, after)))


def main() -> None:
    result = run_in_directory(save_and_reload)
    log.info(
        "%s reloaded: predictions equal %s (max difference %g)",
        result.path,
        result.equal,
        result.max_difference,
    )
    if not result.equal:
        raise SystemExit("predictions differ after reload")


if __name__ == "__main__":
    main()
