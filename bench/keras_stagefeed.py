"""The ``keras-stagefeed`` mode of ``bench steps``: ``model.fit`` on stagefeed's TF 2 feed.

Nothing is reimplemented: ``consumer.tf2.served_feed.ServedFeed`` (the intake, the eager FIFOQueue,
the tf.data pipeline ending in the device buffer, the books) is fed by real producer processes
(``producer.pool.Producers``) over ``--transport``, exactly as a Keras user's trainer is, and
``fit`` gets the feed's booking callback as a user's would. The dataset hands Keras
``(images, labels)`` in their wire dtypes (``cast="step"``): the model's first layer casts uint8
images on the training device, as in the other Keras modes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import keras

from stagefeed.bench.config import StepsConfig
from stagefeed.bench.feed_path import Loopback
from stagefeed.bench.keras_modes import KerasMode
from stagefeed.consumer.tf2.served_feed import ServedFeed
from stagefeed.producer.pool import pool_check

log = logging.getLogger(__name__)

STAGE_DEPTH = 2
SETTLE_TIMEOUT_S = 60.0
POLL_S = 0.02


class KerasStagefeedMode(KerasMode):
    """``ServedFeed`` bound on a loopback endpoint, ``config.producers`` producers feeding it."""

    name = "keras-stagefeed"

    def __init__(self, config: StepsConfig, device: str) -> None:
        super().__init__(config, device)
        self.link = Loopback(config, "bench-keras")
        self.feed: ServedFeed | None = None
        self._producers_ok: Any = None

    def dataset(self) -> tuple[Any, dict[str, Any]]:
        config, link = self.config, self.link
        options = link.trainer_options(STAGE_DEPTH, self.device)
        self.feed = ServedFeed(options)
        self._producers_ok = pool_check(link.start_producers(self.feed.endpoint))
        dataset = self.feed.dataset(("images", "labels"), cast="step")
        return dataset, {
            "endpoint": self.feed.endpoint,
            "producers": config.producers,
            "enqueue_threads": config.enqueue_threads,
            "queue_capacity": options.queue_capacity,
            "stage_depth": STAGE_DEPTH,
        }

    def callbacks(self) -> list[keras.callbacks.Callback]:
        assert self.feed is not None
        return [self.feed.callback()]

    def setup(self) -> dict[str, Any]:
        info = super().setup()
        info["queue_full_at_start"] = self.settle()["queue_full"]
        return info

    def settle(self) -> dict[str, Any]:
        """Wait until the intake has refilled the queue (producers kept up)."""
        assert self.feed is not None
        queue = self.feed.queue
        started = time.monotonic()
        while queue.size() < queue.capacity:
            self._check()
            if time.monotonic() - started > SETTLE_TIMEOUT_S:
                break
            time.sleep(POLL_S)
        return {
            "queue_full": queue.size() >= queue.capacity,
            "settle_s": round(time.monotonic() - started, 3),
        }

    def feed_cpu_s(self) -> float | None:
        """``Loopback.feed_cpu_s``: producers, ZeroMQ I/O, intake, enqueue and pool threads."""
        return self.link.feed_cpu_s()

    def close(self) -> None:
        """The producers first, then the feed (its queue closes: a blocked dequeue ends), then
        ``fit``'s thread."""
        if self.fit is not None:
            self.fit.release()
        self.link.close()
        self._producers_ok = None  # the pool's last reference here (bench.worker's exit)
        if self.feed is not None:
            self.feed.close()
        super().close()

    def _check(self) -> None:
        assert self.feed is not None
        self.feed.check()
        self._producers_ok()
