"""Records from a folder of images whose sub-folders are the classes.

The layout Keras' ``image_dataset_from_directory`` reads: ``DIR/cat/1.jpg``,
``DIR/dog/7.png``, ... The classes are the sub-folders in sorted order (label ``k`` is the
``k``-th), the records every image file under them, sorted by class then path. Record ``i``
is ``{"images": uint8[H, W, 3], "labels": int32}``, decoded here in the producer: JPEG with
simplejpeg when it is installed (``stagefeed[images]``), anything else, and JPEG without
it, with Pillow; an image of another size is resized to ``size`` (bilinear). ``size``
defaults to the first image's. An image that cannot be decoded is a ``BadRecord`` naming it.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import Schema
from stagefeed.producer.data.records import BadRecord, Field

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
_JPEG = (".jpg", ".jpeg")


def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _pillow(origin: str) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(
            f"{origin}: decoding images needs Pillow: pip install 'stagefeed[images]'"
        ) from None
    return Image


class ImageFolder:
    """The images under ``root``'s class folders; ``size`` is ``(height, width)`` or None
    (the first image's)."""

    def __init__(self, root: str, size: tuple[int, int] | None = None) -> None:
        self.origin = f"images:{root}"
        if not os.path.isdir(root):
            raise ConfigError(f"{self.origin}: no such folder")
        self.classes = sorted(
            e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")
        )
        self.paths: list[str] = []
        labels: list[int] = []
        for label, name in enumerate(self.classes):
            files = sorted(_images_under(os.path.join(root, name)))
            self.paths += files
            labels += [label] * len(files)
        if not self.paths:
            raise ConfigError(
                f"{self.origin}: no images ({', '.join(EXTENSIONS)}) in class folders "
                f"({len(self.classes)} folders)"
            )
        self.labels = np.asarray(labels, np.int32)
        self._image = _pillow(self.origin)
        self._jpeg = _simplejpeg()
        self.size = size if size is not None else self._first_size()

    def _first_size(self) -> tuple[int, int]:
        errors = []
        for index in range(min(len(self.paths), 16)):
            try:
                first = self._decode(index)
            except BadRecord as exc:
                errors.append(str(exc))
                continue
            return int(first.shape[0]), int(first.shape[1])
        raise ConfigError(f"{self.origin}: none of the first images decodes: {errors[0]}")

    @property
    def decoder(self) -> str:
        return "simplejpeg" if self._jpeg is not None else "Pillow"

    def __len__(self) -> int:
        return len(self.paths)

    def fields(self) -> dict[str, Field]:
        return {
            "images": Field("uint8", (*self.size, 3), cast="float32", scale=1.0 / 255.0),
            "labels": Field("int32", (), bounds=(0, len(self.classes))),
        }

    def fit(self, schema: Schema) -> None:
        """Decode to the size of the schema's ``images`` (an ``(H, W, 3)`` array)."""
        spec = next((s for s in schema.arrays if s.name == "images"), None)
        if spec is not None and len(spec.shape) == 3 and spec.shape[2] == 3:
            self.size = (spec.shape[0], spec.shape[1])

    def where(self, index: int) -> str:
        return f"{self.paths[index]} (record {index})"

    def record(self, index: int) -> dict[str, np.ndarray]:
        pixels = self._decode(index)
        if pixels.shape[:2] != self.size:
            height, width = self.size
            resized = self._image.fromarray(pixels).resize((width, height), self._image.BILINEAR)
            pixels = np.asarray(resized)
        return {"images": pixels, "labels": self.labels[index]}

    def _decode(self, index: int) -> np.ndarray:
        path = self.paths[index]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise BadRecord(f"{self.where(index)}: cannot be read: {exc}") from None
        if self._jpeg is not None and path.lower().endswith(_JPEG):
            try:
                return self._jpeg.decode_jpeg(data, colorspace="RGB")
            except ValueError as exc:
                raise BadRecord(f"{self.where(index)}: not a decodable JPEG: {exc}") from None
        try:
            with self._image.open(io.BytesIO(data)) as image:
                return np.asarray(image.convert("RGB"))
        except (OSError, ValueError, SyntaxError) as exc:
            raise BadRecord(f"{self.where(index)}: not a decodable image: {exc}") from None


def _images_under(folder: str) -> list[str]:
    found = []
    for parent, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(parent, f) for f in files if f.lower().endswith(EXTENSIONS)]
    return found
