"""What both stagefeed modes of ``bench steps`` share: the loopback link and the producers.

The graph mode (``bench.stagefeed_mode``, the real ``Trainer``) and the Keras mode
(``bench.keras_stagefeed``, the real ``ServedFeed``) bind the same kind of endpoint for
``--transport``, start the same ``producer.pool.Producers`` and count the same threads and
processes as the feed path's CPU. No TensorFlow here.

Lifecycle: ``Loopback(config)`` (picks the endpoint) -> ``trainer_options(...)`` for the
trainer side -> ``start_producers(endpoint)`` -> ``close()`` (idempotent: stops the
producers, removes the ipc socket file).
"""

from __future__ import annotations

import logging
import os
import tempfile

from stagefeed.bench.config import StepsConfig
from stagefeed.bench.cpu import process_cpu_s, sum_cpu_s, threads_cpu_s
from stagefeed.common.options import MIB, ProducerOptions, TrainerOptions
from stagefeed.consumer.devices import is_gpu
from stagefeed.producer.pool import Producers

log = logging.getLogger(__name__)

# Each producer may hold this many batches unsent (bounds its memory: one more for filling).
PRODUCER_UNSENT_BATCHES = 4
# The trainer-side threads of the feed path (consumer.intake.intake, consumer.intake.shm_gate) and
# ZeroMQ's I/O threads.
FEED_THREADS = ("stagefeed-intake", "stagefeed-enqueue", "stagefeed-shm-pools")
ZMQ_THREADS = ("ZMQbg/IO",)


class Loopback:
    """The endpoint of one mode's trainer side, and the producer processes feeding it.

    ``tcp``: an ephemeral loopback port. ``ipc``: a socket file in the temp directory.
    ``shm``: batches in slots of shared-memory pools, control over ipc, pools offered on a
    unix socket beside it (consumer/intake/shm_gate.py).
    """

    def __init__(self, config: StepsConfig, name: str = "bench") -> None:
        self.config = config
        self.shared = config.transport == "shm"
        self._ipc_path: str | None = None
        if config.transport in ("ipc", "shm"):
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"stagefeed-{name}-{os.getpid()}")
            self.bind = f"ipc://{self._ipc_path}"
        else:
            self.bind = "tcp://127.0.0.1:*"
        self.pool: Producers | None = None

    @property
    def trainer_transport(self) -> str:
        """``TrainerOptions.transport`` (and the producers'): ``shm`` or ``zmq``."""
        return "shm" if self.shared else "zmq"

    @property
    def shm_socket(self) -> str | None:
        return f"{self._ipc_path}-shm/pools.sock" if self.shared else None

    def trainer_options(self, stage_depth: int, device: str, **extra) -> TrainerOptions:
        """The trainer side's options: this endpoint and transport, the run's schema, enqueue
        threads, and a queue of ``config.queue_capacity`` batches; ``device`` a TF device
        name; ``extra`` any other ``TrainerOptions`` field."""
        config, schema = self.config, self.config.schema
        return TrainerOptions(
            bind=self.bind,
            schema=schema,
            enqueue_threads=config.enqueue_threads,
            queue_mb=config.queue_capacity * schema.batch_bytes / MIB,
            queue_batches=config.queue_capacity,
            stage_depth=stage_depth,
            device="gpu" if is_gpu(device) else "cpu",
            transport=self.trainer_transport,
            shm_socket=self.shm_socket,
            shm_producers=config.producers,
            **extra,
        )

    def start_producers(self, endpoint: str) -> Producers:
        """``config.producers`` producer processes of the synthetic source, connected."""
        config, schema = self.config, self.config.schema
        options = ProducerOptions(
            connect=endpoint,
            workers=config.producers,
            schema=schema,
            inflight_mb=PRODUCER_UNSENT_BATCHES * schema.batch_bytes / MIB,
            transport=self.trainer_transport,
        )
        self.pool = Producers(options, logging.getLogger().level).start()
        return self.pool

    def feed_cpu_s(self) -> float | None:
        """CPU seconds so far of the feed path: producer processes, ZeroMQ I/O threads, the
        intake thread, the enqueue threads and the pool thread of this process (its
        TensorFlow threads are not counted)."""
        if self.pool is None:
            return None
        producers = [process_cpu_s(p.pid) for p in self.pool.processes]
        return sum_cpu_s([*producers, threads_cpu_s(FEED_THREADS, ZMQ_THREADS)])

    def close(self) -> None:
        """Idempotent: stop the producers, drop the pool (so its semaphores are released now:
        ``bench.worker`` ends without Python's finalization), remove the ipc socket file."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
