"""The shared-memory content canary: a source, a model and two child roles for the shm tests.

- ``SCHEMA``: ``pixels`` uint8 [4, 65536] and ``tag`` int64 [4] (256 KiB a batch).
- ``source``: a *filling* source (it writes into the slot it is given). Batch k (k counts from
  0 per producer, so k is the producer's seq) is every pixel ``k % 251`` and every tag ``k``,
  written in ``CANARY_CHUNKS`` chunks with ``CANARY_FILL_DELAY_S`` between them, so a producer
  killed with -9 is most likely killed mid-write.
- ``model_fn``: checks every staged batch against the seq TensorFlow queued with it
  (``consumer.graph.feed_graph.STAGED_SEQ``): all pixels ``seq % 251`` and all tags ``seq``. The
  loss is
  the running count of corrupted batches, so the summary's ``loss_last`` is the total.
  ``consistent_fn`` checks a batch against its own tag (for runs that lose batches).

Child roles (real processes, real sockets):

- ``python -m tests.helpers.shm_canary trainer [--early] TRAIN_ARGS...``: ``stagefeed train``; with
  ``--early`` every slot is released the moment its descriptor is accepted, while TensorFlow
  still aliases it (the mistake the canary must catch).
- ``python -m tests.helpers.shm_canary producer CONNECT [MAX_BATCHES]``: one producer process over
  shared memory that poisons (0xEE) each slot the moment its release arrives, before the
  slot is free again; prints ``poisoned N`` when it ends (SIGTERM, or after MAX_BATCHES).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

from stagefeed.common.schema import ArraySpec, Schema

SCHEMA = Schema((ArraySpec("pixels", "uint8", (65536,)), ArraySpec("tag", "int64")), batch_size=4)
POISON = 0xEE


class _Canary:
    def __init__(self, schema: Schema, worker) -> None:
        self.count = 0
        self.chunks = int(os.environ.get("CANARY_CHUNKS", "1"))
        self.delay_s = float(os.environ.get("CANARY_FILL_DELAY_S", "0"))

    def fill(self, out) -> bool:
        pixels = out["pixels"].reshape(-1)
        step = -(-pixels.size // self.chunks)
        out["tag"][:] = self.count
        for start in range(0, pixels.size, step):
            pixels[start : start + step] = self.count % 251
            if self.delay_s:
                time.sleep(self.delay_s)
        self.count += 1
        return True


def source(schema: Schema, worker) -> _Canary:
    return _Canary(schema, worker)


def model_fn(staged, schema):
    """(running count of corrupted batches, its update): every batch checked against its seq."""
    import tensorflow as tf

    from stagefeed.consumer.graph.feed_graph import STAGED_SEQ

    v1 = tf.compat.v1
    (seq,) = v1.get_collection(STAGED_SEQ)
    pixels = tf.cast(staged["pixels"], tf.int64)
    wrong = tf.logical_or(
        tf.reduce_any(tf.not_equal(pixels, seq % 251)),
        tf.reduce_any(tf.not_equal(staged["tag"], seq)),
    )
    count = v1.get_variable(
        "corrupted", [], tf.int64, initializer=v1.zeros_initializer(), trainable=False
    )
    update = v1.assign_add(count, tf.cast(wrong, tf.int64))
    return tf.cast(update, tf.float32), update.op


def consistent_fn(staged, schema):
    """Like ``model_fn``, but checks each batch against its own tag only (every pixel
    ``tag % 251``, one tag per batch): for runs where a producer loses batches (a trainer
    restart) and its seq and the source's count part."""
    import tensorflow as tf

    v1 = tf.compat.v1
    tag = staged["tag"]
    pixels = tf.cast(staged["pixels"], tf.int64)
    wrong = tf.logical_or(
        tf.reduce_any(tf.not_equal(pixels, tag[0] % 251)),
        tf.reduce_any(tf.not_equal(tag, tag[0])),
    )
    count = v1.get_variable(
        "corrupted", [], tf.int64, initializer=v1.zeros_initializer(), trainable=False
    )
    update = v1.assign_add(count, tf.cast(wrong, tf.int64))
    return tf.cast(update, tf.float32), update.op


def _release_early() -> None:
    from stagefeed.common.shm.mapped import MappedPool

    view = MappedPool.view

    def early(self, desc):
        views = view(self, desc)
        self._on_release(self.pool_id, desc.slot, desc.gen)  # TF has not even been fed it yet
        return views

    MappedPool.view = early


def _trainer(args: list[str]) -> int:
    if args[:1] == ["--early"]:
        _release_early()
        args = args[1:]
    from stagefeed.cli import main

    return main(["train", "--schema", "tests.helpers.shm_canary:SCHEMA", "--model",
                 "tests.helpers.shm_canary:model_fn", "--transport", "shm", *args])  # fmt: skip


def _producer(connect: str, max_batches: int) -> int:
    from stagefeed.common.errors import ClosedError
    from stagefeed.common.logs import setup_logging
    from stagefeed.common.options import ProducerOptions
    from stagefeed.common.shm.layout import COMMITTED
    from stagefeed.common.shm.slots import SlotPool
    from stagefeed.producer.worker import produce, worker_info

    setup_logging(20)
    release = SlotPool.release
    poisoned = [0]

    def poisoning(self, slot, gen):
        with self._cond:
            due = 0 <= slot < self.slots and self._state[slot] == COMMITTED
            due = due and self._gen[slot] == gen
            if due:  # while the slot is still ours: nothing can acquire it meanwhile
                for array in self._views[slot].values():
                    array.view(np.uint8).fill(POISON)
                poisoned[0] += 1
        return release(self, slot, gen)

    SlotPool.release = poisoning
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    options = ProducerOptions(
        connect=connect, source="tests.helpers.shm_canary:source", transport="shm",
        max_batches=max_batches,
    )  # fmt: skip
    try:
        produce(options, worker_info(options, 0), stop)
    except ClosedError:
        pass  # SIGTERM
    except Exception as exc:  # noqa: BLE001 - the test reads this line
        print(f"producer failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"poisoned {poisoned[0]}", flush=True)
    return 0


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "trainer":
        sys.exit(_trainer(rest))
    sys.exit(_producer(rest[0], int(rest[1]) if len(rest) > 1 else 0))
