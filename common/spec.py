"""What a batch looks like: the contract between producers and the trainer."""

from __future__ import annotations

import dataclasses

import numpy as np
from stagefeed.common.errors import ConfigError

# Dtypes a message may declare, by their numpy ``dtype.str``. Object, void, structured and
# string dtypes are absent on purpose: decoding them could execute or allocate arbitrarily.
ALLOWED_DTYPES: frozenset[str] = frozenset(
    ["|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"]
)

IMAGE_DTYPES = ("float32", "uint8")
IMAGES = "images"
LABELS = "labels"


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Shape and type of every batch: ``images`` (B, H, W, C) and int32 ``labels`` (B,).

    The defaults are the seed's AlexNet input: 227x227x3 images, 1000 classes.
    ``uint8`` images move a quarter of the bytes; the trainer casts and scales them on the device.
    """

    batch_size: int = 256
    height: int = 227
    width: int = 227
    channels: int = 3
    image_dtype: str = "float32"
    num_classes: int = 1000

    def __post_init__(self) -> None:
        for name in ("batch_size", "height", "width", "channels", "num_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.image_dtype not in IMAGE_DTYPES:
            raise ConfigError(
                f"image dtype must be one of {', '.join(IMAGE_DTYPES)}, got {self.image_dtype!r}"
            )
        if self.num_classes > np.iinfo(np.int32).max:
            raise ConfigError(f"num_classes too large for int32 labels: {self.num_classes}")

    @property
    def image_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.height, self.width, self.channels)

    @property
    def label_shape(self) -> tuple[int]:
        return (self.batch_size,)

    def arrays(self) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...]:
        """(name, dtype, shape) of each array, in wire order."""
        return (
            (IMAGES, np.dtype(self.image_dtype), self.image_shape),
            (LABELS, np.dtype(np.int32), self.label_shape),
        )

    @property
    def batch_bytes(self) -> int:
        """Payload bytes of one batch (images + labels), headers excluded."""
        return sum(dtype.itemsize * int(np.prod(shape)) for _, dtype, shape in self.arrays())
