"""``bench ingest``: how many GB/s producers -> ZeroMQ -> intake -> FIFOQueue deliver.

The trainer is the real one (``consumer.graph.trainer.Trainer`` with its intake, FIFOQueue and
StagingArea) with ``trivial_model_fn`` as its model, so a step costs almost nothing and the
step rate is the delivery rate. Each measurement is reported next to raw pyzmq for the same
messages, transport and sender count, measured just before or after it (the order
alternates), and next to single-core memcpy, measured after each pair. ``shm`` (batches in
shared-memory slots, the producers copying the synthetic batch into each slot, control over
ipc) has no raw pyzmq of its own: its peer is raw pyzmq over tcp, the transport it replaces.

Each timed window also gives the feed path's CPU, in core-ms per batch (psutil; None without
it): the producer processes, and the trainer's intake, enqueue and pool threads and ZeroMQ's
I/O threads; for raw pyzmq, the senders and the receiving process.

Raw pyzmq's receiver runs in this process, so the trainer's malloc policy
(``consumer.memory.malloc_policy``, process-wide once applied) is applied before the first
measurement
(by the command line before any other thread starts, as for ``stagefeed train``): every raw
figure of a run is then taken under the same heap settings as the trainer's, the stronger
ceiling (without it the first raw measurement of a run page-faulted and later ones did not).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from stagefeed.bench.config import IN_PLACE, IngestConfig
from stagefeed.bench.rawzmq import endpoint_for, measure_memcpy, measure_raw
from stagefeed.bench.report import machine
from stagefeed.bench.sources import LABELS_IN_PLACE
from stagefeed.common.errors import ClosedError
from stagefeed.common.lifecycle import on_stop_signals
from stagefeed.common.options import ProducerOptions, TrainerOptions
from stagefeed.common.schema import Schema
from stagefeed.consumer.books.ledger import LedgerSnapshot
from stagefeed.consumer.graph.trainer import Trainer
from stagefeed.consumer.memory import malloc_policy
from stagefeed.consumer.run_facts import StepRecord
from stagefeed.producer.pool import Producers, pool_check

log = logging.getLogger(__name__)

STAGE_DEPTH = 1
FEED_THREADS = ("stagefeed-intake", "stagefeed-enqueue", "stagefeed-shm-pools")


def raw_peer(transport: str) -> str:
    """The transport raw pyzmq is measured over, next to ``transport``."""
    return "tcp" if transport == "shm" else transport


def _feed_cpu_s(pool: Producers | None) -> float | None:
    """CPU seconds of the feed path so far (module docstring); None without psutil."""
    if pool is None:
        return None
    try:
        from stagefeed.bench.cpu import process_cpu_s, sum_cpu_s, threads_cpu_s
    except ImportError:
        return None
    producers = [process_cpu_s(p.pid) for p in pool.processes]
    return sum_cpu_s([*producers, threads_cpu_s(FEED_THREADS, ("ZMQbg/IO",))])


def trivial_model_fn(
    staged: dict[str, tf.Tensor], schema: Schema
) -> tuple[tf.Tensor, tf.Operation]:
    """Reads the labels and one pixel of every image: proves the batch arrived, costs ~nothing."""
    del schema
    images, labels = staged["images"], staged["labels"]
    probe = tf.reduce_sum(tf.cast(images[:, 0, 0, 0], tf.float32))
    loss = tf.cast(tf.reduce_max(labels), tf.float32) + 0.0 * probe
    return loss, loss.op


def delivery_schema(schema: Schema) -> Schema:
    """``schema`` without device-side casts: the same arrays, bytes and messages.

    The trainer casts every staged array its schema says to cast *before* the model sees it
    (``consumer.cast.cast_arrays``), and TensorFlow computes the whole cast even when the
    model then reads one pixel: for uint8 that would be a full uint8 -> float32 conversion of
    every batch, which a real model pays but a delivery measurement must not. Without the
    cast the trivial model gets the batch as delivered, as before the schema existed.
    """
    arrays = tuple(dataclasses.replace(a, cast=None, scale=None) for a in schema.arrays)
    return dataclasses.replace(schema, arrays=arrays)


class _Clock:
    """A ``StepObserver`` that picks the timed steps and ends training after ``count``.

    Timing starts ``warmup`` steps after every producer has delivered a batch, so producers
    that start late, and batches buffered while the trainer started, fall in the warm-up.
    """

    def __init__(self, producers: int, warmup: int, count: int, outer: threading.Event):
        self.producers, self.warmup, self.count = producers, warmup, count
        self.outer = outer
        self.done = threading.Event()
        self.all_seen_at_step: int | None = None
        self.start_at: float | None = None
        self.timed: list[StepRecord] = []
        self.pool: Producers | None = None
        self.books: Callable[[], LedgerSnapshot] | None = None  # the trainer's ledger reads
        self.cpu_s: list[float | None] = []  # the feed path's, at the window's start and end
        self.window_books: LedgerSnapshot | None = None  # the ledger when the last timed step ended

    def on_step(self, record: StepRecord) -> None:
        assert self.books is not None, "set the clock's books before training"
        if self.all_seen_at_step is None and self.books().delivering >= self.producers:
            self.all_seen_at_step = record.step
        if self.all_seen_at_step is not None:
            if record.step == self.all_seen_at_step + self.warmup:
                self.start_at = record.at
                self.cpu_s = [_feed_cpu_s(self.pool)]
            elif self.start_at is not None:
                self.timed.append(record)
        if len(self.timed) >= self.count or self.outer.is_set():
            if self.start_at is not None and len(self.cpu_s) == 1:
                self.cpu_s.append(_feed_cpu_s(self.pool))
                self.window_books = self.books()
            self.done.set()


def measure_stagefeed(
    schema: Schema,
    producers: int,
    transport: str,
    count: int,
    device: str,
    stop: threading.Event,
    log_level: int = logging.WARNING,
    fill: str = "copy",
) -> dict[str, Any]:
    """GB/s over ``count`` consumed batches, timed once the start-up buffers were drained.

    Warm-up drains what the queue, staging area and the intake's credit pool can hold, so the
    timed steps wait on delivery alone. Enqueue threads (``enqueue_threads``) = producers.
    Trainer and producers both use ``delivery_schema(schema)``: ``schema``'s messages, and no
    cast before the trivial model. ``fill`` (shm only): ``copy`` the synthetic batch into each
    slot, or ``inplace`` (``bench.sources.labels_in_place``).
    """
    schema = delivery_schema(schema)
    capacity = max(2, producers)
    # Queue, staging, the batch a step holds, then 3 per producer: the count used since the
    # receive pool (pipes + proxy), more than the intake's credit pool (enqueue_threads + 2).
    buffered = capacity + STAGE_DEPTH + 1 + 3 * producers
    bind, ipc_path = endpoint_for(transport, "ingest")
    shared = transport == "shm"
    shm_socket = os.path.join(
        tempfile.gettempdir(), f"stagefeed-bench-shm-{os.getpid()}", "pools.sock"
    )
    options = TrainerOptions(
        bind=bind,
        schema=schema,
        enqueue_threads=producers,
        steps=0,  # until the clock says done
        warmup_steps=0,  # the clock decides which steps are timed
        queue_mb=(capacity * schema.batch_bytes + 1) / 2**20,
        queue_batches=capacity,
        stage_depth=STAGE_DEPTH,
        device=device,
        transport="shm" if shared else "zmq",
        shm_socket=shm_socket if shared else None,
        shm_producers=producers,
    )
    clock = _Clock(producers, buffered + 2, count, stop)
    trainer = Trainer(options, [clock], model_fn=trivial_model_fn)
    clock.books = trainer.reader.books
    pool: Producers | None = None
    try:
        trainer.start()
        pool = Producers(
            ProducerOptions(
                connect=trainer.endpoint,
                workers=producers,
                schema=schema,
                inflight_mb=2 * schema.batch_bytes / 2**20,
                transport="shm" if shared else "zmq",
                source=LABELS_IN_PLACE if fill == IN_PLACE else "synthetic",
            ),
            log_level,
        ).start()
        clock.pool = pool
        trainer.train(clock.done, health_check=pool_check(pool))
    finally:
        if pool is not None:
            pool.close()
        trainer.close()
        if ipc_path and os.path.exists(ipc_path):
            os.unlink(ipc_path)
    if stop.is_set() or len(clock.timed) < count or clock.start_at is None:
        raise ClosedError(f"stopped after {len(clock.timed)} of {count} timed batches")
    elapsed = clock.timed[-1].at - clock.start_at
    totals = trainer.ledger.totals()
    # Drops up to the window's end say whether the figure is sound; any after it, while the
    # run stops, are reported apart.
    window_dropped = clock.window_books.totals.dropped if clock.window_books else totals.dropped
    return {
        "batches": count,
        "warmup_batches": clock.timed[0].step - 1,
        "bytes": count * schema.batch_bytes,
        "seconds": round(elapsed, 4),
        "gb_per_s": round(count * schema.batch_bytes / elapsed / 1e9, 3),
        # The consumer is far faster than delivery, so this is near 100%: it says the step
        # waited on delivery, i.e. the figure is the feed path's, not the consumer's.
        "consumer_wait_pct": round(100 * sum(r.wait_s for r in clock.timed) / elapsed, 2),
        "received": totals.received,
        "dropped": window_dropped,
        "dropped_at_stop": totals.dropped - window_dropped,
        "device": trainer.device,
        "core_ms_per_batch": _per_batch_ms(clock.cpu_s, count),
        "shm": trainer.shm_stats(),
    }


def _per_batch_ms(cpu_s: list[float | None], count: int) -> float | None:
    if len(cpu_s) != 2 or None in cpu_s:
        return None
    return round((cpu_s[1] - cpu_s[0]) * 1000 / count, 3)  # type: ignore[operator]


def _compare(
    config: IngestConfig,
    schema: Schema,
    transport: str,
    fill: str,
    producers: int,
    raw_first: bool,
    stop: threading.Event,
    log_level: int,
) -> dict[str, Any]:
    """Raw pyzmq and stagefeed, ``config.repeats`` times each in alternating order, with a
    memcpy measurement after each pair (load on a shared machine changes within minutes, so
    every peer is measured next to the row it is compared with); medians."""
    count = config.batches_for(schema["images"].dtype)
    samples: dict[str, list[dict[str, Any]]] = {"raw": [], "stagefeed": []}
    memcpy: list[dict[str, Any]] = []
    for repeat in range(config.repeats):
        raw_now = raw_first == (repeat % 2 == 0)
        for which in ("raw", "stagefeed") if raw_now else ("stagefeed", "raw"):
            if stop.is_set():
                raise ClosedError("stop requested")
            if which == "raw":
                peer = raw_peer(transport)
                samples["raw"].append(measure_raw(schema, producers, peer, count, log_level))
            else:
                samples["stagefeed"].append(
                    measure_stagefeed(
                        schema, producers, transport, count, config.device, stop, log_level, fill
                    )
                )
        memcpy.append(measure_memcpy(schema, config.memcpy_repeats))
    result: dict[str, Any] = {
        "memcpy": {
            "gb_per_s": round(statistics.median(m["gb_per_s"] for m in memcpy), 3),
            "samples": memcpy,
        }
    }
    for which, runs in samples.items():
        cpu = [r["core_ms_per_batch"] for r in runs if r.get("core_ms_per_batch") is not None]
        result[which] = {
            "gb_per_s": round(statistics.median(r["gb_per_s"] for r in runs), 3),
            "core_ms_per_batch": round(statistics.median(cpu), 3) if cpu else None,
            "samples": runs,
        }
    result["ratio"] = round(result["stagefeed"]["gb_per_s"] / result["raw"]["gb_per_s"], 3)
    result["raw_first"] = raw_first
    result["raw_transport"] = raw_peer(transport)
    return result


def run_ingest(config: IngestConfig, log_level: int = logging.INFO) -> dict[str, Any]:
    """Every (dtype, transport, producers) measurement; Ctrl-C stops between measurements."""
    conditions = machine()
    largest = max(config.schema(dtype).largest_array_bytes for dtype in config.dtypes)
    conditions["malloc_policy"] = malloc_policy.keep_freed_memory(largest)
    stop = threading.Event()
    restore = on_stop_signals(lambda _sig: stop.set())
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        combos = itertools.product(config.dtypes, config.variants(), config.producers)
        for index, (dtype, (transport, fill), producers) in enumerate(combos):
            if stop.is_set():
                raise ClosedError("stop requested")
            schema = config.schema(dtype)
            run: dict[str, Any] = {
                "dtype": dtype,
                "batch_mb": round(schema.batch_bytes / 1e6, 2),
                "transport": transport,
                "fill": fill,
                "producers": producers,
                "enqueue_threads": producers,
                "batches_per_measurement": config.batches_for(dtype),
            }
            raw_first = index % 2 == 0
            run.update(
                _compare(config, schema, transport, fill, producers, raw_first, stop, log_level)
            )
            log.info(
                "%s %s (%s) x%d: raw %.3f GB/s, stagefeed %.3f GB/s (%.2fx)",
                dtype,
                transport,
                fill,
                producers,
                run["raw"]["gb_per_s"],
                run["stagefeed"]["gb_per_s"],
                run["ratio"],
            )
            runs.append(run)
    finally:
        restore()
    conditions["load_avg_1m_end"] = machine()["load_avg_1m"]
    conditions["wall_s"] = round(time.monotonic() - started, 1)
    return {
        "benchmark": "ingest",
        "settings": {
            "dtypes": list(config.dtypes),
            "producers": list(config.producers),
            "transports": list(config.transports),
            "shm_fills": list(config.shm_fills),
            "batch_size": config.batch_size,
            "image_size": config.image_size,
            "gb_per_measurement": config.gb,
            "repeats": config.repeats,
        },
        "machine": conditions,
        "tensorflow": tf.__version__,
        "runs": runs,
    }
