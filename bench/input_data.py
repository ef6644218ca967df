"""``bench input``'s data: a folder of JPEGs made at start, and the Python decode every mode shares.

The folder has ``ImageFolder``'s layout (``DIR/<class>/<n>.jpg``, two classes), so stagefeed
reads it with its built-in ``images:DIR`` source. The Python modes (the ideal, tf.data's
``from_generator``, Keras' ``PyDataset``) decode it with the same ``ImageFolder`` (simplejpeg
when installed, else Pillow) and the same crop and flip, each record's generator drawn from
``(seed, epoch, index)`` as stagefeed's ``--transform`` gets it. No TensorFlow here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.producer.data.images import ImageFolder
from stagefeed.producer.data.transform import record_rng

CLASSES = ("a", "b")
JPEG_QUALITY = 90
# The ``--transform`` module written beside the images: ``stagefeed run`` imports it from its
# working directory, the folder's parent (``common.refs.import_ref``), in every producer.
TRANSFORM_MODULE = "bench_input_augment"
TRANSFORM_SOURCE = '''"""Written by stagefeed bench input: its crop and flip, for --transform."""
from stagefeed.bench.input_data import crop_flip

CROP = {crop}


def transform(record, rng):
    return {{"images": crop_flip(record["images"], CROP, rng), "labels": record["labels"]}}
'''


def make_images(root: str, count: int, size: int, seed: int = 0) -> str:
    """Write ``count`` JPEGs of ``size`` x ``size`` under ``root/images/<class>/``; return the
    images folder. Smooth random colour fields with grain: JPEGs of a photo's density (a
    224-pixel photo is some 20-40 KB), not pure noise (several times that, and slower)."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            "bench input writes JPEGs with Pillow: pip install 'stagefeed[images]'"
        ) from None
    folder = os.path.join(root, "images")
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
    for index in range(count):
        coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), np.int16)
        grain = rng.integers(-24, 25, (size, size, 3), dtype=np.int16)
        pixels = np.clip(field + grain, 0, 255).astype(np.uint8)
        path = os.path.join(folder, CLASSES[index % len(CLASSES)], f"{index:05d}.jpg")
        Image.fromarray(pixels).save(path, quality=JPEG_QUALITY)
    return folder


def write_transform(root: str, crop: int) -> str:
    """Write the ``--transform`` module into ``root``; return its ``module:function``."""
    with open(os.path.join(root, f"{TRANSFORM_MODULE}.py"), "w", encoding="utf-8") as f:
        f.write(TRANSFORM_SOURCE.format(crop=int(crop)))
    return f"{TRANSFORM_MODULE}:transform"


def crop_flip(image: np.ndarray, crop: int, rng: np.random.Generator) -> np.ndarray:
    """A random ``crop`` x ``crop`` window of ``image`` [H, W, C], mirrored left-right half the
    time (contiguous: a batch row copies it as it is)."""
    top = int(rng.integers(0, image.shape[0] - crop + 1))
    left = int(rng.integers(0, image.shape[1] - crop + 1))
    window = image[top : top + crop, left : left + crop]
    if rng.random() < 0.5:
        window = window[:, ::-1]
    return np.ascontiguousarray(window)


class PythonDecode:
    """The decode of every Python mode: record ``index`` of the folder in ``epoch``, decoded,
    cropped and flipped, with labels; epochs in an order drawn from ``(seed, epoch)``.

    Pickles as its settings (a ``PyDataset`` worker may get it pickled): the reader, which
    holds the decoder's module, is opened again where it is used."""

    def __init__(self, folder: str, crop: int, seed: int = 0) -> None:
        self.folder = folder
        self.crop = crop
        self.seed = seed
        self._images: ImageFolder | None = None

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "crop": self.crop, "seed": self.seed, "_images": None}

    @property
    def images(self) -> ImageFolder:
        if self._images is None:
            self._images = ImageFolder(self.folder)
        return self._images

    @property
    def decoder(self) -> str:
        return self.images.decoder

    def __len__(self) -> int:
        return len(self.images)

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.images))

    def sample(self, index: int, epoch: int) -> tuple[np.ndarray, np.int32]:
        record = self.images.record(index)
        rng = record_rng(self.seed, epoch, index)
        return crop_flip(record["images"], self.crop, rng), record["labels"]

    def samples(self) -> Iterator[tuple[np.ndarray, np.int32]]:
        """Every record of epoch 0, then epoch 1, ... without end."""
        epoch = 0
        while True:
            for index in self.order(epoch):
                yield self.sample(int(index), epoch)
            epoch += 1

    def batch(self, number: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Global batch ``number`` of the endless sequence of epochs (short tails dropped)."""
        per_epoch = len(self.images) // batch_size
        epoch, place = divmod(number, per_epoch)
        indices = self.order(epoch)[place * batch_size : (place + 1) * batch_size]
        images = np.empty((batch_size, self.crop, self.crop, 3), np.uint8)
        labels = np.empty((batch_size,), np.int32)
        for row, index in enumerate(indices):
            images[row], labels[row] = self.sample(int(index), epoch)
        return images, labels
