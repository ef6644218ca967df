"""``Feed``: the TF 2 trainer-side feed as one object (queue, dataset, books, Keras hooks).

A sketch of use (docs/tf2.md has the full story)::

    feed = Feed(schema, capacity=64, stage_depth=2, sink=ledger)
    # enqueue threads: feed.enqueue(arrays, peer, seq)
    model.fit(feed.dataset(("images", "labels")), steps_per_epoch=100, epochs=3,
              callbacks=[feed.callback()])
    feed.close()

Keras' ``fit`` path (``consumer.keras_fit``: the callback, the cast layer, the model check) is
imported by the methods that return or run it, so a custom loop that only wants the feed and
its dataset loads none of it.

Lifecycle: create eagerly (outside ``tf.function``) -> ``dataset()`` once -> train, booking
each step (``callback()`` with ``fit``; ``books.step_done()`` in a custom loop) -> ``close()``
(idempotent: blocked enqueues return False, the dataset ends once the queue is drained).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import check_stage_depth
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.cast import cast_arrays
from stagefeed.consumer.tf2 import pipeline
from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed
from stagefeed.consumer.tf2.pass_gate import PassGate
from stagefeed.consumer.tf2.step_books import (
    BooksFigures,
    BooksSink,
    DequeueLog,
    StepBooks,
    TrainedStep,
)

if TYPE_CHECKING:
    import keras

    from stagefeed.consumer.keras_fit.callback import FeedCallback

# Room in the dequeue log beyond the queue: buffers hold at most a few batches per replica.
LOG_HEADROOM = 4096


class Feed:
    """Batches from producers into ``fit`` or a custom loop, with per-step books.

    ``capacity``: queue depth in batches (derive it from a byte budget with
    ``schema.batch_bytes``). ``stage_depth``: batches per replica buffered on the training
    device ahead of the step. ``sink``: an object with ``trained(peers, seqs)`` (and optionally
    ``abandoned(peers, seqs)``), e.g. the trainer's ``Ledger``: told after every booked step.

    The books of each step (docs/tf2.md, "The books"): ``last_step`` is the ``TrainedStep``
    (which ``(peer, seq)`` batches the latest step trained); ``figures()`` the running
    ``BooksFigures`` (trained, abandoned, queued, input wait). Steps are booked by
    ``callback()`` in ``fit``, or by ``books.step_done()`` after each step of a custom loop.
    """

    def __init__(
        self,
        schema: Schema,
        capacity: int,
        *,
        stage_depth: int = 2,
        device: str = "auto",
        sink: BooksSink | None = None,
    ) -> None:
        check_stage_depth(stage_depth)
        self.queue = EagerQueueFeed(schema, capacity, device)
        self.schema = schema
        self.stage_depth = stage_depth
        self.books = StepBooks(self.queue, DequeueLog(capacity + LOG_HEADROOM), sink)
        self._dataset: Any = None
        self._targets: tuple[ArraySpec, ...] | None = None  # y's array, when the mapping names it
        # Ends an iterator at a pass boundary (``ServedFeed``: sources with passes); None here.
        self.gate: PassGate | None = None

    def enqueue(self, arrays: Mapping[str, np.ndarray], peer: int, seq: int) -> bool:
        """``EagerQueueFeed.enqueue``: blocks while full, False once closed."""
        return self.queue.enqueue(arrays, peer, seq)

    def dataset(
        self,
        mapping: pipeline.ElementMapping = None,
        *,
        strategy: tf.distribute.Strategy | None = None,
        cast: pipeline.CastWhere = "pipeline",
    ) -> tf.data.Dataset | tf.distribute.DistributedDataset:
        """The dataset to train on; call once per feed (a queue has one consumer).

        ``mapping``: None (dicts of arrays), ``("images", "labels")``-style names for Keras'
        ``(x, y[, sample_weight])``, or a callable on the dict. ``strategy``: distribute with
        a device buffer per replica (default: the strategy in scope, if any); without one the
        dataset ends in ``prefetch_to_device``. ``cast``: ``"pipeline"`` casts/scales in
        tf.data on the host; ``"step"`` leaves wire dtypes for ``cast()``/``cast_layer()``.
        """
        if self._dataset is not None:
            raise ConfigError(
                "dataset() was already called: a feed has one consumer, reuse that dataset"
            )
        self._dataset, per_step = pipeline.build(
            self.queue,
            self.books.dequeues,
            mapping=mapping,
            cast=cast,
            strategy=strategy,
            stage_depth=self.stage_depth,
            gate=self.gate,
        )
        self.books.batches_per_step = per_step
        y = mapping[1] if isinstance(mapping, Sequence) and len(mapping) > 1 else None
        self._targets = (self.schema[y],) if isinstance(y, str) else None  # one named y
        return self._dataset

    def check_model(self, model: keras.Model) -> None:
        """Before ``fit``, after ``dataset()``: ``ConfigError`` naming ``model`` if it is not
        compiled with a loss, if its sparse categorical crossentropy has fewer classes than
        the target array's declared ``bounds`` (a mapping that names y), or if one training
        step on this dataset's elements cannot be traced (forward pass and loss; nothing runs;
        not for a dataset distributed by a strategy). What ``fit`` would raise at its first
        step, or train wrong on a GPU, said at once in one line."""
        from stagefeed.consumer.keras_fit.model_check import check_fit

        if self._dataset is None:
            raise ConfigError("check_model(model): call dataset() first, it makes the elements")
        spec = self._dataset.element_spec if isinstance(self._dataset, tf.data.Dataset) else None
        check_fit(model, spec, self._targets)

    def fit_begins(self, epochs: int, steps: int | None) -> bool:
        """(``FeedCallback``) ``fit(epochs=epochs)`` begins, ``steps`` a step each epoch (None:
        not given): True if its epochs are passes (``ServedFeed``); a plain feed has none."""
        return False

    def passes_ended(self, trained: int) -> int:
        """(``FeedCallback``, epochs that are passes) how many passes the first ``trained``
        batches completed since the last call."""
        return 0

    def raise_owed_interrupt(self) -> None:
        """(``FeedCallback``, after each step) a Ctrl-C this feed deferred is raised now
        (``ServedFeed``); a plain feed takes no signal."""

    def cast(self, batch: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        """The schema's cast/scale, for a step to call on its device (``cast="step"``)."""
        return cast_arrays(self.schema, batch)

    def cast_layer(self, name: str) -> keras.layers.Layer:
        """A built-in Keras layer doing array ``name``'s cast/scale inside the model."""
        if name not in self.schema.names:
            raise ConfigError(f"no array {name!r:.40} in the schema {list(self.schema.names)}")
        from stagefeed.consumer.keras_fit.callback import cast_layer

        return cast_layer(self.schema[name])

    def callback(self, prefix: str = "stagefeed_", *, check_model: bool = True) -> FeedCallback:
        """A Keras callback booking each step and adding the feed's figures to the logs; at
        ``fit``'s start it runs ``check_model`` on the model (``check_model=False``: the
        caller has checked it)."""
        from stagefeed.consumer.keras_fit.callback import FeedCallback

        return FeedCallback(self, prefix, check_model)

    def figures(self) -> BooksFigures:
        """A snapshot of the books (exact when no dequeue is in progress)."""
        return self.books.figures()

    @property
    def last_step(self) -> TrainedStep | None:
        """The batches the latest booked step trained; None before the first."""
        return self.books.last_step

    def close(self) -> None:
        """Idempotent: stop taking batches; the dataset ends after the queued ones."""
        self.queue.close()

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
