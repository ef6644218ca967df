"""Options of producers and the trainer: frozen dataclasses validated at construction.

A bad value raises ``ConfigError`` naming the field and the value, before anything starts.
"""

from __future__ import annotations

import dataclasses
import re

from stagefeed.common import endpoints
from stagefeed.common.errors import ConfigError
from stagefeed.common.spec import BatchSpec

DEVICES = ("auto", "cpu", "gpu")
MIB = 2**20


def check_endpoint(field: str, value: str) -> None:
    """``ConfigError`` naming ``field`` and ``value`` unless ``value`` is a usable endpoint.

    A field named like a bind address (``bind``, ``STAGEFEED_BIND``) may use wildcards (host
    ``*``, port ``*`` or 0, ``ipc://*``); any other field names an address to connect to.
    """
    endpoints.parse(field, value, bind=field.lower().endswith("bind"))


def _positive(field: str, value: float, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{field} must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ProducerOptions:
    """One producer process's settings (``stagefeed produce`` starts ``workers`` of them).

    ``inflight_mb`` bounds the bytes a producer holds: at most
    ``max(1, inflight_mb // batch_mb)`` batches sit unsent in ZeroMQ, plus one being filled.
    """

    connect: str = "tcp://127.0.0.1:5555"
    workers: int = 1
    spec: BatchSpec = dataclasses.field(default_factory=BatchSpec)
    source: str = "synthetic"
    inflight_mb: float = 512.0
    rate: float = 0.0  # batches per second per worker; 0 = as fast as the trainer takes them
    max_batches: int = 0  # per worker; 0 = until stopped
    seed: int = 0
    curve_keys: str | None = None  # directory written by ``stagefeed keygen``

    def __post_init__(self) -> None:
        check_endpoint("connect", self.connect)
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers must be an integer >= 1, got {self.workers!r}")
        _positive("inflight_mb", self.inflight_mb)
        _positive("rate", self.rate, zero_ok=True)
        _positive("max_batches", self.max_batches, zero_ok=True)
        if self.source != "synthetic" and not re.fullmatch(r"[\w.]+:\w+", self.source):
            raise ConfigError(f"source must be 'synthetic' or module:function, got {self.source!r}")

    @property
    def max_unsent(self) -> int:
        """Batches a producer may have handed to ZeroMQ and not yet seen sent."""
        return max(1, int(self.inflight_mb * MIB) // self.spec.batch_bytes)


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """The trainer's settings.

    Bytes held by the trainer are bounded by ``queue_mb`` (the FIFOQueue) plus
    ``stage_depth + 2 + 4 * recv_threads`` batches (staged; the one a step trains on; the
    proxy's; per receive thread two in its inproc pipe, whose high-water mark is the sum of
    both ends', one in hand and TensorFlow's copy of it while the enqueue waits), plus two
    messages per connected producer (one waiting at receive high-water mark 1, one being
    decoded; three with CURVE, see ``common.curve``). ``max_message_mb`` caps each frame, not
    a message: see docs/guarantees.md for what that means with untrusted peers.
    """

    bind: str = "tcp://*:5555"
    spec: BatchSpec = dataclasses.field(default_factory=BatchSpec)
    recv_threads: int = 2
    steps: int = 100  # timed steps; 0 = until stopped
    warmup_steps: int = 2  # trained before the timed steps, not timed
    queue_mb: float = 2048.0
    stage_depth: int = 2
    device: str = "auto"
    max_message_mb: float = 0.0  # 0 = one batch plus 1 MiB
    curve_keys: str | None = None
    wait_log_s: float = 10.0  # how often to say "waiting for data" while starved
    keep_freed_memory: bool = True  # see consumer/malloc_policy.py

    def __post_init__(self) -> None:
        check_endpoint("bind", self.bind)
        if not isinstance(self.recv_threads, int) or not 1 <= self.recv_threads <= 64:
            raise ConfigError(
                f"recv_threads must be an integer in [1, 64], got {self.recv_threads!r}"
            )
        _positive("steps", self.steps, zero_ok=True)
        _positive("warmup_steps", self.warmup_steps, zero_ok=True)
        _positive("queue_mb", self.queue_mb)
        _positive("max_message_mb", self.max_message_mb, zero_ok=True)
        _positive("wait_log_s", self.wait_log_s)
        if not isinstance(self.stage_depth, int) or not 1 <= self.stage_depth <= 16:
            raise ConfigError(
                f"stage_depth must be an integer in [1, 16], got {self.stage_depth!r}"
            )
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.queue_mb * MIB < self.spec.batch_bytes:
            raise ConfigError(
                f"queue_mb={self.queue_mb} holds no batch of {self.spec.batch_bytes / MIB:.1f} MiB"
            )
        if self.max_message_mb and self.max_message_mb * MIB < self.spec.batch_bytes:
            raise ConfigError(
                f"max_message_mb={self.max_message_mb} is smaller than one batch "
                f"({self.spec.batch_bytes / MIB:.1f} MiB)"
            )

    @property
    def queue_capacity(self) -> int:
        """FIFOQueue capacity in batches, derived from the byte budget."""
        return max(1, int(self.queue_mb * MIB) // self.spec.batch_bytes)

    @property
    def max_message_bytes(self) -> int:
        if self.max_message_mb:
            return int(self.max_message_mb * MIB)
        return self.spec.batch_bytes + MIB
