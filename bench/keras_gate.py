"""One ``model.fit`` call driven step by step: how the Keras modes of ``bench steps`` are timed.

Why one long ``fit`` and not one ``fit(steps_per_epoch=k, epochs=1)`` per turn: every ``fit``
call makes a new iterator over its dataset (Keras keeps one only across the epochs of a
call). A new iterator restarts ``from_generator``'s generator with an empty prefetch buffer,
and drops the batches stagefeed's device buffer had dequeued (abandoned, in the books): the
first step of every turn would pay for that, and not the same for every mode. So each mode runs
one ``fit`` on its own thread for as many steps as the run needs, and a callback holds that
thread after every step until the coordinator asks for the next one, as the graph stagefeed
mode's gate observer does.

A step's time is taken by the same callback: from ``on_train_batch_begin`` to
``on_train_batch_end``, i.e. Keras' ``train_function`` (the ``next()`` on the dataset
iterator, inside the traced function, and the step), the callbacks given before the gate
(stagefeed's booking callback), and the logs' conversion to Python numbers, which waits for
the step to finish. The gate defines ``on_train_batch_end``, so Keras never dispatches batch
ends asynchronously while it is there.

Lifecycle: ``GatedFit(...)`` -> ``start()`` (the first step runs untimed: tracing) ->
``step()`` ... -> ``close()`` (idempotent: the held thread lets ``fit`` stop after its step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from stagefeed.common.errors import BrokenError
from stagefeed.common.lifecycle import join_threads

log = logging.getLogger(__name__)

GATE_POLL_S = 0.1
JOIN_TIMEOUT_S = 10.0
# fit's steps_per_epoch: more than any run asks for; the coordinator decides how many run.
FIT_STEPS = 2**31 - 1


class _Gate(keras.callbacks.Callback):
    """Times each batch and holds the training thread after it until released."""

    def __init__(self, records: queue.Queue, go: threading.Semaphore, stop: threading.Event):
        super().__init__()
        self._records, self._go, self._stop = records, go, stop
        self._started = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._records.put(time.perf_counter() - self._started)
        while not self._go.acquire(timeout=GATE_POLL_S):
            if self._stop.is_set():
                break
        if self._stop.is_set():
            self.model.stop_training = True  # fit checks it after every batch


class GatedFit:
    """``model.fit(dataset, ...)`` on a thread named ``bench-{name}-fit``, under ``device``.

    Invariant: at most one step runs per ``step()`` call (the gate's semaphore).
    """

    def __init__(
        self,
        name: str,
        model: keras.Model,
        dataset: Any,
        device: str,
        callbacks: Sequence[keras.callbacks.Callback] = (),
    ) -> None:
        self.model, self.dataset, self.device = model, dataset, device
        self._stop = threading.Event()
        self._go = threading.Semaphore(0)
        self._records: queue.Queue[float | None] = queue.Queue()
        self._callbacks = [*callbacks, _Gate(self._records, self._go, self._stop)]
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._fit, name=f"bench-{name}-fit")

    def start(self, timeout_s: float) -> float:
        """Start ``fit``; return the first (untimed) step's seconds once it has run."""
        self._thread.start()
        return self._next(timeout_s)

    def step(self, timeout_s: float) -> float:
        """Release one step and return its seconds."""
        self._go.release()
        return self._next(timeout_s)

    def release(self) -> None:
        """Let the held thread go with ``stop_training`` set: ``fit`` ends after this step."""
        self._stop.set()
        self._go.release()

    def close(self) -> None:
        """Idempotent: ``release()``, then join the training thread."""
        self.release()
        if self._thread.is_alive():
            join_threads([self._thread], JOIN_TIMEOUT_S)

    def _fit(self) -> None:
        try:
            with tf.device(self.device):  # tf.device is per thread: set it on this one
                self.model.fit(
                    self.dataset,
                    steps_per_epoch=FIT_STEPS,
                    epochs=1,
                    callbacks=self._callbacks,
                    shuffle=False,
                    verbose=0,
                )
        except Exception as exc:  # noqa: BLE001 - handed to step(), never swallowed
            if not self._stop.is_set():
                log.exception("%s failed", self._thread.name)
                self._failure = exc
        finally:
            self._records.put(None)

    def _next(self, timeout_s: float) -> float:
        try:
            seconds = self._records.get(timeout=timeout_s)
        except queue.Empty:
            raise BrokenError(f"no Keras step within {timeout_s:.0f} s") from None
        if seconds is None:
            if self._failure is not None:
                raise BrokenError(f"model.fit failed: {self._failure!r}") from self._failure
            raise BrokenError("model.fit ended before the run did")
        return seconds
