"""Settings of ``bench steps`` and ``bench ingest``: frozen dataclasses validated at construction.

A bad value raises ``ConfigError`` naming it before any process starts. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses

from stagefeed.common.checks import check_number
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import MIB
from stagefeed.common.schema import Schema, image_schema

# The graph family: compat.v1 sessions training ``consumer.graph.alexnet``'s AlexNet.
STEP_MODES = (
    "synthetic-device",
    "synthetic-host",
    "feed_dict",
    "seed-staging",
    "tf.data",
    "stagefeed",
    "stagefeed-tcp",
)
# The Keras family: ``model.fit`` of the same AlexNet in Keras 3 (``bench.keras_model``).
KERAS_MODES = ("keras-synthetic", "keras-from_generator", "keras-stagefeed")
ALL_MODES = STEP_MODES + KERAS_MODES
# ``--modes`` also takes a family's name for all its modes.
FAMILIES = {"graph": STEP_MODES, "keras": KERAS_MODES, "all": ALL_MODES}
# Each family's ratios are against its own upper bound, measured in the same run.
REFERENCES = {"graph": "synthetic-device", "keras": "keras-synthetic"}
# Loopback transports of the feed path; ``shm``: batches in shared-memory slots (control over
# ipc), measured next to raw pyzmq over tcp.
TRANSPORTS = ("tcp", "ipc", "shm")
# How a shm producer writes a batch: copies the synthetic batch into the slot, or fills the
# slot in place (bench.sources.labels_in_place).
COPY, IN_PLACE = "copy", "inplace"
SHM_FILLS = (COPY, IN_PLACE)
# Image dtypes the benchmarks make batches of (``common.schema.image_schema`` takes the same).
IMAGE_DTYPES = ("float32", "uint8")
DEVICES = ("auto", "cpu", "gpu")
# The seed pre-filled a FIFOQueue of 106 batches before timing.
SEED_QUEUE_DEPTH = 106
# consumer.graph.alexnet.check_schema says the same with TensorFlow imported; checked here so a bad
# flag fails before any worker process starts.
MIN_IMAGE_SIZE = 195


def check_image_size(height: int, width: int) -> None:
    if min(height, width) < MIN_IMAGE_SIZE:
        raise ConfigError(
            f"AlexNet needs images of at least {MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE} pixels, "
            f"got {height}x{width}"
        )


def check_image_schema(schema: Schema) -> None:
    """``ConfigError`` unless ``schema`` is the seed's AlexNet input that the benchmarks make
    batches of: ``images`` [H, W, C] of an ``IMAGE_DTYPES`` dtype, at least 195x195, then
    bounded int32 ``labels`` (what ``image_schema`` builds)."""
    if not isinstance(schema, Schema) or schema.names != ("images", "labels"):
        names = list(schema.names) if isinstance(schema, Schema) else type(schema).__name__
        raise ConfigError(f"the benchmarks need arrays ['images', 'labels'], got {names}")
    images, labels = schema["images"], schema["labels"]
    if len(images.shape) != 3 or images.dtype not in IMAGE_DTYPES:
        raise ConfigError(
            f"the benchmarks need images [H, W, C] of {' or '.join(IMAGE_DTYPES)}, "
            f"got {images.dtype}{list(images.shape)}"
        )
    check_image_size(images.shape[0], images.shape[1])
    if labels.shape != () or labels.dtype != "int32" or labels.bounds is None:
        raise ConfigError("the benchmarks need int32 labels [B] with bounds [0, num_classes)")


def family(mode: str) -> str:
    """``"keras"`` or ``"graph"``: which table a mode belongs to, and whose ratio it gets."""
    return "keras" if mode in KERAS_MODES else "graph"


def expand_modes(names: tuple[str, ...]) -> tuple[str, ...]:
    """``--modes``: family names (``graph``, ``keras``, ``all``) become their modes, in
    order; a mode named twice is kept once. Unknown names are left for ``StepsConfig``."""
    out: list[str] = []
    for name in names:
        for mode in FAMILIES.get(name, (name,)):
            if mode not in out:
                out.append(mode)
    return tuple(out)


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def _subset(name: str, values: tuple, allowed: tuple) -> None:
    if not values:
        raise ConfigError(f"{name} is empty; choose from {', '.join(map(str, allowed))}")
    for value in values:
        if value not in allowed:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{name} lists a value twice: {', '.join(map(str, values))}")


@dataclasses.dataclass(frozen=True)
class StepsConfig:
    """``bench steps``: every mode trains the same AlexNet step on the same batch shape (the
    graph family ``consumer.graph.alexnet``'s, the Keras family the same network in Keras).

    ``steps`` timed steps per mode are split into ``rounds`` blocks (0: one step per block,
    the finest interleaving); the modes take turns block by block (forward order, then
    reversed, ...) so load that comes and goes on a shared machine biases none of them.
    ``queue_mb`` bounds the queue-fed modes (seed-staging, stagefeed, keras-stagefeed) alike.
    """

    modes: tuple[str, ...] = STEP_MODES
    schema: Schema = dataclasses.field(default_factory=lambda: image_schema(batch_size=64))
    steps: int = 24
    warmup_steps: int = 2
    rounds: int = 0
    producers: int = 2
    enqueue_threads: int = 2
    # The stagefeed modes' loopback: shm, what ``run`` uses on one host (``stagefeed-tcp``
    # is the same feed over tcp whatever this says: what producers on other hosts use).
    transport: str = "shm"
    queue_mb: float = 1024.0
    seed_prestage: int = 1
    device: str = "auto"

    def __post_init__(self) -> None:
        _subset("modes", self.modes, ALL_MODES)
        _at_least("steps", self.steps, 1)
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("rounds", self.rounds, 0)
        if self.rounds > self.steps:
            raise ConfigError(f"rounds={self.rounds} exceeds steps={self.steps}")
        _at_least("producers", self.producers, 1)
        _at_least("enqueue_threads", self.enqueue_threads, 1)
        _at_least("seed_prestage", self.seed_prestage, 0)
        _subset("transport", (self.transport,), TRANSPORTS)
        _subset("device", (self.device,), DEVICES)
        check_image_schema(self.schema)
        check_number("queue_mb", self.queue_mb)
        if self.queue_mb * MIB < self.schema.batch_bytes:
            batch_mib = self.schema.batch_bytes / MIB
            raise ConfigError(f"queue_mb={self.queue_mb} holds no batch of {batch_mib:.1f} MiB")

    @property
    def queue_capacity(self) -> int:
        """Batches the queue-fed modes hold (the seed's 106 at most)."""
        return max(1, min(SEED_QUEUE_DEPTH, int(self.queue_mb * 2**20) // self.schema.batch_bytes))

    @property
    def round_count(self) -> int:
        return self.rounds or self.steps

    def blocks(self) -> list[int]:
        """Timed steps per round, summing to ``steps``."""
        base, extra = divmod(self.steps, self.round_count)
        return [base + (1 if r < extra else 0) for r in range(self.round_count)]


@dataclasses.dataclass(frozen=True)
class IngestConfig:
    """``bench ingest``: one measurement per (dtype, producers, transport).

    ``producers`` producer processes feed as many enqueue threads; ``gb`` is how many bytes
    (1e9) each timed measurement moves, after warm-up batches that drain the start-up buffers;
    ``repeats`` measurements of each peer (alternating order) give the reported medians.
    """

    dtypes: tuple[str, ...] = IMAGE_DTYPES
    producers: tuple[int, ...] = (1, 2, 4)
    transports: tuple[str, ...] = TRANSPORTS
    # shm rows: the producer copies the batch into its slot, and/or fills the slot in place
    # (``bench.sources.labels_in_place``: the transport's own cost)
    shm_fills: tuple[str, ...] = SHM_FILLS
    batch_size: int = 256
    image_size: int = 227
    gb: float = 3.0
    repeats: int = 3
    memcpy_repeats: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        _subset("dtypes", self.dtypes, IMAGE_DTYPES)
        _subset("transports", self.transports, TRANSPORTS)
        _subset("shm_fills", self.shm_fills, SHM_FILLS)
        if not self.producers or any(
            not isinstance(p, int) or not 1 <= p <= 16 for p in self.producers
        ):
            raise ConfigError(f"producers must be integers in [1, 16], got {self.producers!r}")
        _at_least("batch_size", self.batch_size, 1)
        _at_least("memcpy_repeats", self.memcpy_repeats, 1)
        _at_least("repeats", self.repeats, 1)
        _subset("device", (self.device,), DEVICES)
        check_number("gb", self.gb)
        if self.gb > 1000:
            raise ConfigError(f"gb must be in (0, 1000], got {self.gb!r}")
        check_image_schema(self.schema(self.dtypes[0]))  # batch_size and image_size

    def schema(self, dtype: str) -> Schema:
        """The batches of one measurement: the seed's image schema with ``dtype`` images."""
        return image_schema(batch_size=self.batch_size, image_size=self.image_size, dtype=dtype)

    def variants(self) -> list[tuple[str, str]]:
        """``(transport, fill)`` pairs measured: each shm fill, ``copy`` for the others."""
        return [
            (transport, fill)
            for transport in self.transports
            for fill in (self.shm_fills if transport == "shm" else (COPY,))
        ]

    def batches_for(self, dtype: str) -> int:
        """Timed batches for ``gb`` bytes of ``dtype`` batches (at least 3)."""
        return max(3, round(self.gb * 1e9 / self.schema(dtype).batch_bytes))
