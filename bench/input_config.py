"""Settings of ``bench input``: a frozen dataclass validated at construction.

A bad value raises ``ConfigError`` naming it before any file is written or process started.
No TensorFlow here.
"""

from __future__ import annotations

import dataclasses

from stagefeed.bench.config import _at_least, _subset
from stagefeed.common.errors import ConfigError

IDEAL = "ideal"
STAGEFEED = "stagefeed"
TF_DATA = "tf.data"
FROM_GENERATOR = "from_generator"
PYDATASET = "pydataset"
# In the order they run and the table shows them. ``stagefeed`` is one row per transport.
INPUT_MODES = (IDEAL, STAGEFEED, TF_DATA, FROM_GENERATOR, PYDATASET)
# Modes run once per --producers value (N producers, N PyDataset workers); the others once.
PER_PRODUCERS = (STAGEFEED, PYDATASET)
INPUT_TRANSPORTS = ("shm", "tcp")
MAX_PRODUCERS = 16
MAX_IMAGES = 100_000
MAX_IMAGE_SIZE = 4096
MIN_CROP = 8


@dataclasses.dataclass(frozen=True)
class InputConfig:
    """``bench input``: the same JPEG folder decoded, cropped, flipped and trained on by each mode.

    ``images`` JPEGs of ``image_size`` squared are written at start; each mode trains
    ``warmup_steps`` untimed then ``steps`` timed batches of ``batch_size`` crops of ``crop``
    squared (the ideal decodes as many images, training nothing). ``producers``: the N of
    the per-producer modes (stagefeed over each of ``transports``, PyDataset's workers).
    """

    producers: tuple[int, ...] = (1, 2)
    images: int = 256
    image_size: int = 256
    crop: int = 224
    batch_size: int = 32
    steps: int = 100
    warmup_steps: int = 10
    modes: tuple[str, ...] = INPUT_MODES
    transports: tuple[str, ...] = INPUT_TRANSPORTS
    seed: int = 0

    def __post_init__(self) -> None:
        _subset("modes", self.modes, INPUT_MODES)
        _subset("transports", self.transports, INPUT_TRANSPORTS)
        if not self.producers or any(
            not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= MAX_PRODUCERS
            for p in self.producers
        ):
            raise ConfigError(
                f"producers must be integers in [1, {MAX_PRODUCERS}], got {self.producers!r}"
            )
        if len(set(self.producers)) != len(self.producers):
            raise ConfigError(f"producers lists a value twice: {self.producers!r}")
        _at_least("batch_size", self.batch_size, 1)
        _at_least("images", self.images, 1)
        if self.images < self.batch_size:
            raise ConfigError(f"images={self.images} make no batch of {self.batch_size}")
        if self.images > MAX_IMAGES:
            raise ConfigError(f"images must be at most {MAX_IMAGES}, got {self.images}")
        _at_least("crop", self.crop, MIN_CROP)
        _at_least("image_size", self.image_size, MIN_CROP)
        if self.crop > self.image_size:
            raise ConfigError(f"crop={self.crop} does not fit in image_size={self.image_size}")
        if self.image_size > MAX_IMAGE_SIZE:
            raise ConfigError(
                f"image_size must be at most {MAX_IMAGE_SIZE}, got {self.image_size}"
            )
        _at_least("steps", self.steps, 2)
        _at_least("warmup_steps", self.warmup_steps, 1)
        _at_least("seed", self.seed, 0)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def batches_per_epoch(self) -> int:
        return self.images // self.batch_size

    def runs(self) -> list[tuple[str, str, int]]:
        """``(mode, transport, workers)`` of each measurement, in order: the per-producer
        modes once per ``producers`` value (stagefeed per transport), the others once
        (transport ``""``; workers 1, the ideal's and from_generator's one Python decoder,
        and tf.data's AUTOTUNE reported as 0)."""
        out: list[tuple[str, str, int]] = []
        for mode in INPUT_MODES:
            if mode not in self.modes:
                continue
            if mode == STAGEFEED:
                out += [(mode, t, n) for n in self.producers for t in self.transports]
            elif mode == PYDATASET:
                out += [(mode, "", n) for n in self.producers]
            else:
                out.append((mode, "", 0 if mode == TF_DATA else 1))
        return out
