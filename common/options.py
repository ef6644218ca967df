"""Options of producers and the trainer: frozen dataclasses validated at construction.

A bad value raises ``ConfigError`` naming the field and the value, before anything starts;
every number must be finite (``check_number``: NaN and infinity pass comparisons).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings
from typing import Any

from stagefeed.common import endpoints
from stagefeed.common.checks import (
    check_endpoint,
    check_endpoints,
    check_non_negative_int,
    check_number,
    check_positive_int,
)
from stagefeed.common.data_ref import DATA_KINDS, ON_BAD_RECORD, parse_data_ref
from stagefeed.common.errors import ConfigError
from stagefeed.common.position import MAX_SHARDS
from stagefeed.common.protocol import MAX_HEADER_BYTES as HEADER
from stagefeed.common.schema import DEFAULT_SCHEMA, Schema

DEVICES = ("auto", "cpu", "gpu")
# How batches travel (docs/shm.md): ZeroMQ frames, slots of a shared-memory pool (same host,
# same user; the trainer also takes ZeroMQ batches), or shared memory where it works.
TRANSPORTS = ("zmq", "shm", "auto")
UNIX_PATH_MAX = 107  # bytes of an AF_UNIX socket path (sun_path, less the terminating NUL)
MIB = 2**20
SHORT_BATCH = ("refuse", "drop")  # what a producer does with a source's short batch
ON_NAN = ("stop", "warn")  # what a non-finite loss does: stop training (exit 4), or warn
MAX_UNSENT = 64  # batches a producer holds at most, however small: credit bounds sends anyway
# The FIFOQueue's depth when ``queue_batches`` is not given: a deeper queue of small batches
# only makes producers work ahead for batches the run may never train (a 1.2 MiB batch made a
# 2 GiB queue of 1736 batches, and ``run --steps 10`` received 886 of them to train 12).
AUTO_QUEUE_BATCHES = 64


def _check_transport(value: str) -> None:
    if value not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {value!r}")


MAX_STAGE_DEPTH = 16
MAX_ENQUEUE_THREADS = 64
RECV_THREADS_DEPRECATED = "TrainerOptions.recv_threads is deprecated: say enqueue_threads"


def check_stage_depth(stage_depth: object) -> None:
    """``ConfigError`` unless ``stage_depth`` is an int (not a bool) in [1, 16]: batches staged
    on the device ahead of the step, graph mode and the TF 2 feed alike."""
    check_positive_int("stage_depth", stage_depth, MAX_STAGE_DEPTH)


def _check_shard_group(value: object, workers: int) -> None:
    """``ConfigError`` naming ``value`` unless it is ``(G, K)`` with ``0 <= G < K`` and
    ``K * workers`` shards at most ``MAX_SHARDS`` (what a hello and a position may carry)."""
    if not (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ConfigError(f"shard_group must be (GROUP, GROUPS), two integers, got {value!r:.40}")
    group, groups = value
    if not 0 <= group < groups:
        raise ConfigError(
            f"shard_group {group}/{groups}: expected GROUP/GROUPS with 0 <= GROUP < GROUPS"
        )
    if groups * workers > MAX_SHARDS:
        raise ConfigError(
            f"shard_group {group}/{groups} with workers {workers}: {groups * workers} shards, "
            f"more than {MAX_SHARDS}"
        )


@dataclasses.dataclass(frozen=True)
class ProducerOptions:
    """One producer process's settings (``stagefeed produce`` starts ``workers`` of them).

    ``connect``: the trainers' endpoints, one per trainer worker (a single string is one
    endpoint; ``__post_init__`` makes it a tuple). With several, each worker process keeps a
    channel to every trainer and sends each batch to exactly one of them, the one with the most
    credit (``producer.fanout``, docs/scaling.md). ``heartbeat_timeout_s``: how long a silent
    connection lives (ZeroMQ heartbeats); 0 derives it from the batch size
    (``common.liveness``).
    ``schema``: the batches this producer declares in its hello; ``None`` (no batch flags)
    adopts the trainer's schema from its welcome. ``inflight_mb`` bounds the bytes a producer
    holds: at most ``max_unsent(schema)`` batches (1 to ``MAX_UNSENT``) handed to the channel
    and not yet released by ZeroMQ, plus one being filled (the buffer pool of a filling
    source, and the synthetic source's pool, hold ``max_unsent + 1``).
    """

    connect: tuple[str, ...] | str = ("tcp://127.0.0.1:5555",)
    workers: int = 1
    schema: Schema | None = None  # None: the trainer's, learnt from its welcome
    source: str = "synthetic"
    inflight_mb: float = 512.0
    rate: float = 0.0  # batches per second per worker; 0 = as fast as the trainer takes them
    max_batches: int = 0  # per worker; 0 = until stopped
    seed: int = 0
    curve_keys: str | None = None  # directory written by ``stagefeed keygen``
    transport: str = "zmq"  # "shm": pool slots or fail; "auto": pool slots where they work
    # A source's short batch (fewer rows than the batch size): "refuse" (ConfigError, exit 2)
    # or "drop" (logged and counted), like tf.data's drop_remainder. Never padded.
    short_batch: str = "refuse"
    heartbeat_timeout_s: float = 0.0  # 0: derived from the batch size (common/liveness.py)
    shard_group: tuple[int, int] = (0, 1)  # (G, K): group G of K (``--shard-group G/K``)
    # The built-in data sources' (``source`` ``KIND:PATH``, docs/data.md): shuffle each
    # epoch from ``seed``, a ``module:function`` per record, what a bad record does.
    shuffle: bool = True
    transform: str | None = None
    on_bad_record: str = "fail"

    def __post_init__(self) -> None:
        object.__setattr__(self, "connect", check_endpoints("connect", self.connect))
        check_number("heartbeat_timeout_s", self.heartbeat_timeout_s, zero_ok=True)
        _check_transport(self.transport)
        check_positive_int("workers", self.workers)
        _check_shard_group(self.shard_group, self.workers)
        if self.schema is not None and not isinstance(self.schema, Schema):
            raise ConfigError(f"schema must be a Schema or None, got {type(self.schema).__name__}")
        check_number("inflight_mb", self.inflight_mb)
        check_number("rate", self.rate, zero_ok=True)
        check_non_negative_int("max_batches", self.max_batches)
        check_non_negative_int("seed", self.seed)
        data = parse_data_ref(self.source) if isinstance(self.source, str) else None
        if data is None and self.source != "synthetic" and not re.fullmatch(
            r"[\w.]+:\w+", self.source
        ):
            raise ConfigError(
                f"source must be 'synthetic', module:function or {'|'.join(DATA_KINDS)}:PATH, "
                f"got {self.source!r}"
            )
        _check_data_flags(self, data is not None)
        if self.short_batch not in SHORT_BATCH:
            raise ConfigError(
                f"short_batch must be one of {', '.join(SHORT_BATCH)}, got {self.short_batch!r}"
            )

    def max_unsent(self, schema: Schema) -> int:
        """Batches of ``schema`` a producer may have handed over and not yet seen released."""
        return min(MAX_UNSENT, max(1, int(self.inflight_mb * MIB) // schema.batch_bytes))


def _check_data_flags(options: ProducerOptions, data: bool) -> None:
    """The built-in data sources' options: valid, and given only with one of them."""
    if options.on_bad_record not in ON_BAD_RECORD:
        raise ConfigError(f"on_bad_record must be one of {', '.join(ON_BAD_RECORD)}, "
                          f"got {options.on_bad_record!r}")  # fmt: skip
    if not isinstance(options.shuffle, bool):
        raise ConfigError(f"shuffle must be True or False, got {options.shuffle!r}")
    if options.transform is not None and not re.fullmatch(r"[\w.]+:\w+", options.transform):
        raise ConfigError(f"transform must be module:function, got {options.transform!r}")
    if not data and (options.transform is not None or options.on_bad_record != "fail"
                     or not options.shuffle):  # fmt: skip
        raise ConfigError(
            f"--transform, --on-bad-record and --no-shuffle go with a built-in data source "
            f"({'|'.join(DATA_KINDS)}:PATH), not --source {options.source}"
        )


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """The trainer's settings.

    Bytes held by the trainer are bounded by ``queue_mb`` (the FIFOQueue) plus
    ``stage_depth + 1`` batches (staged, and the one a step trains on), plus the credit pool,
    ``enqueue_threads + 2`` batches (granted to producers and not yet enqueued: in ZeroMQ, in the
    hand-off, in an enqueue thread's hands), plus ``enqueue_threads`` copies TensorFlow makes of
    unaligned frames while an enqueue waits. A connection that ignores flow control can add
    its receive high-water mark (2 messages); ``max_message_mb`` caps each message.

    With ``transport`` ``shm``/``auto`` the same counts hold, in batches, but what is queued,
    staged and in flight from same-host producers are views of their pools: each pool holds
    ``common.shm.sizing.pool_slots(queue_capacity, stage_depth, credit, producers)``
    slots (docs/shm.md "The transport as built").

    ``recv_threads``, the old name of ``enqueue_threads``, is still taken as a keyword and read
    as an attribute, with a ``DeprecationWarning``.
    """

    bind: str = "tcp://*:5555"
    schema: Schema = DEFAULT_SCHEMA
    enqueue_threads: int = 2  # threads moving received batches into the FIFOQueue
    steps: int = 100  # timed steps; 0 = until stopped
    warmup_steps: int = 2  # trained before the timed steps, not timed
    queue_mb: float = 2048.0
    # The FIFOQueue's depth in batches (within ``queue_mb``); 0: ``AUTO_QUEUE_BATCHES``, and
    # no deeper than a run of planned steps trains (``queue_capacity``).
    queue_batches: int = 0
    stage_depth: int = 2
    device: str = "auto"
    max_message_mb: float = 0.0  # 0 = one batch plus 1 MiB
    curve_keys: str | None = None
    wait_log_s: float = 10.0  # how often to say "waiting for data" while starved
    keep_freed_memory: bool = True  # see consumer/memory/malloc_policy.py
    model: str = "alexnet"  # --model: "alexnet" or module:NAME (see consumer/model_ref.py)
    credit_per_producer: int = 2  # batches one producer may have in flight towards us
    producer_timeout_s: float = 10.0  # a connection silent this long is forgotten
    # A TF_CONFIG cluster: how long a worker waits for every other to join (TensorFlow: 1 h).
    cluster_join_s: float = 120.0
    transport: str = "zmq"  # "shm"/"auto": also map producers' pools (ZeroMQ batches still go)
    # Where pools are offered; None: consumer/intake/shm_config.default_socket_path(bind).
    shm_socket: str | None = None
    shm_producers: int = 1  # same-host producers the pools are sized for (docs/shm.md)
    # How long a run is: ``steps_per_epoch`` > 0 makes it ``epochs x steps_per_epoch`` steps,
    # warm-up included (``steps`` is then not used); else ``warmup_steps + steps`` in one epoch.
    # ``epochs`` is also the passes producers whose sources make passes make (docs/resume.md,
    # "Passes"): an epoch is then every shard's pass, as long as the data says.
    epochs: int = 1
    steps_per_epoch: int = 0
    # ``steps`` is the command's default, not asked for (``--steps`` not given): once a source
    # with passes joins, the run's length is its ``epochs`` passes, not ``steps``.
    length_by_passes: bool = False
    save_dir: str | None = None  # what was trained is saved here at the end (docs/tf2.md)
    checkpoint_every: int = 0  # steps between checkpoints under save_dir/checkpoints; 0: none
    # A save_dir holding a run: resume from its newest checkpoint (False), or move it aside
    # and start over (True). docs/resume.md.
    fresh: bool = False
    on_nan: str = "stop"  # a non-finite loss: "stop" (NonFiniteLoss) or "warn" and go on
    # A run whose data ends before ``total_steps`` exits EXIT_SHORT_RUN (5), not 0.
    require_full_run: bool = False
    # Keras models: the arrays fit gets as targets (y); None: every array that is not an input.
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_endpoint("bind", self.bind)
        _check_transport(self.transport)
        if self.shm_socket is not None and (
            not isinstance(self.shm_socket, str)
            or not os.path.isabs(self.shm_socket)
            or len(os.fsencode(self.shm_socket)) > UNIX_PATH_MAX
        ):
            raise ConfigError(
                f"shm_socket must be an absolute path of at most {UNIX_PATH_MAX} bytes "
                f"(a unix socket), got {self.shm_socket!r}"
            )
        check_positive_int("shm_producers", self.shm_producers, 256)
        check_positive_int("enqueue_threads", self.enqueue_threads, MAX_ENQUEUE_THREADS)
        check_non_negative_int("steps", self.steps)
        check_non_negative_int("warmup_steps", self.warmup_steps)
        check_number("queue_mb", self.queue_mb)
        check_non_negative_int("queue_batches", self.queue_batches)
        check_number("max_message_mb", self.max_message_mb, zero_ok=True)
        check_number("wait_log_s", self.wait_log_s)
        check_stage_depth(self.stage_depth)
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not isinstance(self.schema, Schema):
            raise ConfigError(f"schema must be a Schema, got {type(self.schema).__name__}")
        check_positive_int("credit_per_producer", self.credit_per_producer, 64)
        check_number("producer_timeout_s", self.producer_timeout_s)
        check_number("cluster_join_s", self.cluster_join_s)
        if not isinstance(self.model, str) or not (
            self.model == "alexnet" or re.fullmatch(r"[\w.]+:\w+", self.model)
        ):
            raise ConfigError(f"model must be 'alexnet' or module:NAME, got {self.model!r}")
        self._check_run_length()
        for name in ("require_full_run", "fresh", "length_by_passes"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.on_nan not in ON_NAN:
            raise ConfigError(f"on_nan must be one of {', '.join(ON_NAN)}, got {self.on_nan!r}")
        if self.save_dir is not None and (not isinstance(self.save_dir, str) or not self.save_dir):
            raise ConfigError(f"save_dir must name a directory, got {self.save_dir!r}")
        if self.targets is not None:
            missing = [t for t in self.targets if t not in self.schema.names]
            if not self.targets or missing or isinstance(self.targets, str):
                raise ConfigError(
                    f"targets must be names of the schema's arrays {list(self.schema.names)}, "
                    f"got {self.targets!r:.80}"
                )
        if self.queue_mb * MIB < self.schema.batch_bytes:
            raise ConfigError(
                f"queue_mb={self.queue_mb} holds no batch of "
                f"{self.schema.batch_bytes / MIB:.1f} MiB"
            )
        if self.max_message_mb and self.max_message_mb * MIB < self.schema.batch_bytes + HEADER:
            raise ConfigError(
                f"max_message_mb={self.max_message_mb} is smaller than one batch and its header "
                f"({(self.schema.batch_bytes + HEADER) / MIB:.3f} MiB)"
            )

    def _check_run_length(self) -> None:
        check_positive_int("epochs", self.epochs)
        check_non_negative_int("steps_per_epoch", self.steps_per_epoch)
        check_non_negative_int("checkpoint_every", self.checkpoint_every)
        if self.checkpoint_every and self.save_dir is None:
            raise ConfigError(
                f"checkpoint_every={self.checkpoint_every} needs save_dir: checkpoints go to "
                "save_dir/checkpoints"
            )

    @property
    def total_steps(self) -> int:
        """Steps of the whole run, warm-up included; 0: until stopped or the data ends."""
        if self.steps_per_epoch:
            return self.epochs * self.steps_per_epoch
        return self.warmup_steps + self.steps if self.steps else 0

    @property
    def queue_capacity(self) -> int:
        """FIFOQueue capacity in batches: ``queue_batches``, or when that is 0
        ``AUTO_QUEUE_BATCHES`` and at most the planned steps (a run whose length its passes
        decide plans none); never more than ``queue_mb`` holds."""
        held = int(self.queue_mb * MIB) // self.schema.batch_bytes
        wanted = self.queue_batches or AUTO_QUEUE_BATCHES
        if not self.queue_batches and self.total_steps and not self.length_by_passes:
            wanted = min(wanted, self.total_steps)
        return max(1, min(held, wanted))

    def held_bytes_bound(self, connections: int) -> int:
        """The class docstring's bound on batch bytes the trainer holds, with ``connections``
        producers connected (each may add its receive high-water mark of 2 messages)."""
        batch = self.schema.batch_bytes
        in_flight = (self.stage_depth + 1) + (self.enqueue_threads + 2) + self.enqueue_threads
        return (
            (self.queue_capacity + in_flight) * batch + 2 * connections * self.max_message_bytes
        )

    @property
    def max_message_bytes(self) -> int:
        if self.max_message_mb:
            return int(self.max_message_mb * MIB)
        return self.schema.batch_bytes + MIB

    @property
    def recv_threads(self) -> int:
        """Deprecated: ``enqueue_threads``."""
        warnings.warn(RECV_THREADS_DEPRECATED, DeprecationWarning, stacklevel=2)
        return self.enqueue_threads


_UNSET: Any = object()


def _take_recv_threads(init: Any) -> Any:
    """``TrainerOptions(recv_threads=N)``, the old keyword: checked under its own name, then
    taken as ``enqueue_threads`` with a ``DeprecationWarning``; both at once is refused."""

    @functools.wraps(init)
    def __init__(
        self: TrainerOptions, *args: Any, recv_threads: Any = _UNSET, **kwargs: Any
    ) -> None:
        if recv_threads is not _UNSET:
            warnings.warn(RECV_THREADS_DEPRECATED, DeprecationWarning, stacklevel=2)
            check_positive_int("recv_threads", recv_threads, MAX_ENQUEUE_THREADS)
            if "enqueue_threads" in kwargs or len(args) > 2:
                raise ConfigError("give enqueue_threads, not recv_threads too (its old name)")
            kwargs["enqueue_threads"] = recv_threads
        init(self, *args, **kwargs)

    return __init__


TrainerOptions.__init__ = _take_recv_threads(TrainerOptions.__init__)  # type: ignore[method-assign]


# What one producer-to-trainer link carries, MB/s, when nobody says (the advice's yardstick):
# loopback ZeroMQ carried about 1.5 GB/s in one stream on the project's machines
# (docs/observability.md); a real network link is set with --wire-mb-s.
DEFAULT_WIRE_MB_S = 1400.0


@dataclasses.dataclass(frozen=True)
class ObserveOptions:
    """What to show and export. A bad value raises ``ConfigError`` naming it."""

    progress_s: float = 5.0  # seconds between progress log lines (terminal: 0.5 s)
    logdir: str | None = None  # TensorBoard event files go here
    metrics_port: int | None = None  # Prometheus endpoint; 0 picks a free port
    # Loopback unless told: producer ids and the trainer's figures are not for every network.
    metrics_bind: str = "127.0.0.1"
    metrics_producer_labels: bool = False  # per-producer series, labelled with producer ids
    advice_s: float = 300.0  # seconds between advice lines during a run
    wire_mb_s: float = DEFAULT_WIRE_MB_S  # what the producers' link carries (advice only)
    tensorboard_s: float = 2.0  # seconds between TensorBoard flushes

    def __post_init__(self) -> None:
        for name in ("progress_s", "advice_s", "wire_mb_s", "tensorboard_s"):
            check_number(name, getattr(self, name))
        port = self.metrics_port
        if port is not None:
            check_non_negative_int("metrics_port", port, 65535)
        if self.logdir is not None and not self.logdir.strip():
            raise ConfigError(f"logdir must name a directory, got {self.logdir!r}")
        why = endpoints.host_problem(self.metrics_bind, wildcard_ok=False)
        if why:
            raise ConfigError(f"metrics_bind {self.metrics_bind!r}: {why}")
