"""The TF 2 feed's tf.data pipeline: queue -> dict of arrays -> cast -> mapping -> device buffer.

Source: ``from_tensors(0).repeat()`` mapped onto ``queue.dequeue()``, preceded by a ticket
(one generation per iterator, for the books) and an index within the iterator. The dataset is
stateful (no tf.data service, no iterator checkpoints) and auto-sharding is off: each trainer
process reads its own queue.

End of data: ``take_while`` stops at the first element after the queue is closed and empty. A
dequeue already blocked when ``close`` comes fails with OutOfRange, which a TF 2 ``map`` turns
into InvalidArgument instead of an end of sequence, so that one failed element is skipped by
``ignore_errors`` (placed right after the dequeue map, which does nothing else that can fail)
and the next ``take_while`` ends the dataset. ``fit`` and custom loops end cleanly.

Device buffer (``stage_depth`` batches per replica ahead of the step, the StagingArea's role):
with a strategy, ``distribute_datasets_from_function`` with ``InputOptions(
experimental_fetch_to_device=True, experimental_per_replica_buffer_size=stage_depth)``; each
replica receives whole queue elements (no rebatching), so a step consumes one element per
local replica. Without one, ``prefetch_to_device(device, stage_depth)`` as the last transform.
Batches dequeued ahead of the step it trains (measured, TF 2.21): ``stage_depth`` without a
strategy; ``2 * stage_depth`` per replica with one (the host side of the multi-device iterator
buffers as deep as the device side). They are outside the queue's byte budget: add them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import check_stage_depth
from stagefeed.common.schema import Schema
from stagefeed.consumer.cast import cast_arrays
from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed
from stagefeed.consumer.tf2.pass_gate import PassGate
from stagefeed.consumer.tf2.step_books import DequeueLog

log = logging.getLogger(__name__)

# How the pipeline hands each batch over. None: the dict of arrays. A tuple of one to three
# items, (x,), (x, y) or (x, y, sample_weight), each an array name or a list of names (a dict
# of those arrays). Or a callable on the dict (traced once by tf.data, runs on the host).
ElementMapping = Sequence[str | Sequence[str]] | Callable[[dict[str, tf.Tensor]], Any] | None
CastWhere = Literal["pipeline", "step"]


def element_structure(schema: Schema, mapping: ElementMapping) -> Callable[[dict], Any]:
    """The function from the dict of arrays to what the dataset yields; names are checked."""
    if mapping is None:
        return lambda batch: batch
    if callable(mapping):
        return mapping
    if isinstance(mapping, str) or not isinstance(mapping, Sequence) or not 0 < len(mapping) <= 3:
        raise ConfigError(
            "mapping must be None, a callable, or (x,), (x, y) or (x, y, sample_weight) "
            f"of array names, got {mapping!r:.80}"
        )
    parts: list[str | tuple[str, ...]] = []
    for item in mapping:
        names = tuple(item) if isinstance(item, Sequence) and not isinstance(item, str) else (item,)
        for name in names:
            if not isinstance(name, str) or name not in schema.names:
                raise ConfigError(
                    f"mapping names {name!r:.40}, not an array of the schema {list(schema.names)}"
                )
        parts.append(item if isinstance(item, str) else names)

    def structure(batch: dict[str, tf.Tensor]) -> tuple:
        return tuple(
            batch[p] if isinstance(p, str) else {name: batch[name] for name in p} for p in parts
        )

    return structure


def dequeued(
    queue: EagerQueueFeed, dequeues: DequeueLog, gate: PassGate | None = None
) -> tf.data.Dataset:
    """Dicts of the schema's arrays in queue order; every element is logged in ``dequeues``.

    Ends once the queue is closed and empty; with a ``gate``, also where it says so (a pass
    boundary, ``consumer.tf2.pass_gate``).
    """
    fifo = queue.queue
    names = queue.schema.names

    def more(index: tf.Tensor, generation: tf.Tensor) -> tf.Tensor:
        if gate is not None:
            return gate.more(generation)
        return tf.logical_or(tf.logical_not(fifo.is_closed()), fifo.size() > 0)

    def dequeue(index: tf.Tensor, generation: tf.Tensor) -> dict[str, tf.Tensor]:
        fill = fifo.size()
        with tf.control_dependencies([fill]):
            started = tf.timestamp()
        with tf.control_dependencies([started]):
            values = fifo.dequeue()
        with tf.control_dependencies(values):
            waited = tf.timestamp() - started
        *arrays, peer, seq = values
        logged = dequeues.record(generation, index, peer, seq, waited, fill)
        with tf.control_dependencies([logged]):
            return {name: tf.identity(array) for name, array in zip(names, arrays, strict=True)}

    iterators = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).map(
        lambda _: dequeues.take_ticket()
    )
    generations = iterators.flat_map(lambda g: tf.data.Dataset.from_tensors(g).repeat())
    return generations.enumerate().take_while(more).map(dequeue).ignore_errors()


def build(
    queue: EagerQueueFeed,
    dequeues: DequeueLog,
    *,
    mapping: ElementMapping = None,
    cast: CastWhere = "pipeline",
    strategy: tf.distribute.Strategy | None = None,
    stage_depth: int = 2,
    gate: PassGate | None = None,
) -> tuple[tf.data.Dataset | tf.distribute.DistributedDataset, int]:
    """The dataset ``fit`` or a custom loop iterates, and the queue elements one step consumes.
    ``gate``: what decides each dequeue (``dequeued``).

    ``cast="pipeline"`` applies the schema's cast/scale in tf.data (host CPU, before the copy
    to the device); ``"step"`` leaves wire dtypes, for the step to cast on its device.
    """
    if cast not in ("pipeline", "step"):
        raise ConfigError(f"cast must be 'pipeline' or 'step', got {cast!r:.40}")
    check_stage_depth(stage_depth)
    schema = queue.schema
    structure = element_structure(schema, mapping)
    if cast == "pipeline":
        ds = dequeued(queue, dequeues, gate).map(
            lambda batch: structure(cast_arrays(schema, batch))
        )
    else:
        ds = dequeued(queue, dequeues, gate).map(structure)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    # An injected, autotuned prefetch would dequeue 1-2 more batches ahead (measured): they sit
    # outside the queue's byte budget and are lost when the iterator is dropped.
    options.experimental_optimization.inject_prefetch = False
    # Nothing here has a knob to tune, and TF 2.21's autotune thread holds up an iterator's
    # deletion until its optimization period ends, a period that doubles with the iterator's
    # age (measured: 6.8 s to drop an iterator after 14 s of life; 0.0 s without the thread):
    # a stop would wait for it once ``fit`` or a loop drops the iterator. prefetch_to_device's
    # generator starts a second root that reads no options from its input: set them on both.
    options.autotune.enabled = False
    ds = ds.with_options(options)
    strategy = _replicated(strategy)
    if strategy is None:
        log.info(
            "feed dataset: stage depth %d on %s, cast in the %s",
            stage_depth,
            queue.device,
            cast,
        )
        staged = ds.apply(tf.data.experimental.prefetch_to_device(queue.device, stage_depth))
        return staged.with_options(options), 1
    replicas = len(strategy.extended.worker_devices)
    log.info(
        "feed dataset: stage depth %d on each of %s, a step takes %d batches, cast in the %s",
        stage_depth,
        ", ".join(strategy.extended.worker_devices),
        replicas,
        cast,
    )
    # The per-replica buffers are TensorFlow's own iterators, which take no options: theirs
    # keep the autotune thread, and dropping them may wait for it (docs/tf2.md, "Pitfalls").
    input_options = tf.distribute.InputOptions(
        experimental_fetch_to_device=True, experimental_per_replica_buffer_size=stage_depth
    )
    distributed = strategy.distribute_datasets_from_function(lambda _: ds, options=input_options)
    return distributed, replicas


def _replicated(strategy: tf.distribute.Strategy | None) -> tf.distribute.Strategy | None:
    """The strategy whose replicas get device buffers: the one given, else the one in scope;
    None for TensorFlow's default strategy, which has no replica devices to feed.
    """
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    if not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy():
        return None
    return strategy
