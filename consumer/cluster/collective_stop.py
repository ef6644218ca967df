"""The cluster's stop decision: every worker stops at the same step, none waits in a collective.

Each worker has local reasons to end (``consumer.run_end.Ending``): a stop request (signal),
a failure (intake, producers), its step budget, and its data: a worker whose iterator has no
batch for this step cannot take part in the step's gradient all-reduce. The decision is a max
over the workers' votes, and ``Ending`` is ordered (``RUNNING < DRAIN < STOP < FAIL``) for it.

One step, on every worker, in this order:

1. ``fetch(iterator)``: the step's batch. Under ``MultiWorkerMirroredStrategy`` a distributed
   iterator of a dataset of finite or unknown cardinality handles partial batches: its
   ``get_next`` all-reduces how many replicas got a value, a worker whose data ended receives
   an empty (batch size 0) stand-in while another still has data, and every worker raises
   ``OutOfRangeError`` together once none has. So the fetch never leaves a worker behind; an
   empty batch is this worker's "no batch". (``distribute()`` makes an infinite dataset
   finite, so every worker's fetch runs the same collective.)
2. ``vote(local, sizes)``: one all-reduce (SUM) of a small int vector, two slots per replica:
   the replica's vote (``local``, raised to ``DRAIN`` if its batch is empty) and its batch
   size. Every worker gets the same vector, so the same ``ClusterVerdict``: its ``ending`` is
   the max of the votes, ``workers`` who voted it, ``global_batch`` the step's total size.
   Once every worker's data ended (``fetch`` returned None, on every worker at once) the
   ballot still goes round, with sizes 0, so that a stop or a failure is not taken for the end
   of the data: a stop that closed every queue before any batch came is still a ``STOP``.
3. The train step runs only if ``verdict.go`` (every vote ``RUNNING``); otherwise the loop
   ends and the fetched batches are not trained.

Invariant: every worker calls ``fetch`` then ``vote`` exactly once per loop iteration and
runs the train step exactly when ``verdict.go``; these are the only collectives of the loop.
Since every worker sees the same verdict, every worker runs the same sequence of collectives
and leaves the loop after the same step. What can still break it is a worker that raises
(or dies) between two collectives: the others wait in the next one until the collective
timeout or the coordination service's heartbeat fails them (docs/scaling.md, "A worker
dies"). A non-finite loss needs no vote: the step's loss is all-reduced, so every worker
sees the same value at the same step and applies the same loss policy.

Local votes: ``vote_for(verdict)`` maps a worker's ``RunEnd`` verdict to its vote. ``DRAIN``
(its data ended) votes ``RUNNING``: the worker trains its queued tail, and the end of the tail
shows as an empty batch, a ``DRAIN`` vote, at the step where it has nothing left.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from stagefeed.consumer.run_end import Ending, Verdict

log = logging.getLogger(__name__)

# A dataset of this cardinality is "finite" for the strategy's partial-batch handling and
# will not end in any run (2**62 steps).
NEVER_ENDS = 2**62


def vote_for(verdict: Verdict) -> Ending:
    """A worker's vote from its ``RunEnd`` verdict: ``DRAIN`` trains the tail (``RUNNING``)."""
    return Ending.RUNNING if verdict.ending is Ending.DRAIN else verdict.ending


@dataclasses.dataclass(frozen=True)
class ClusterVerdict:
    """What every worker decided together at one step (identical on every worker)."""

    ending: Ending
    votes: tuple[Ending, ...]  # per worker: the highest vote of its replicas
    global_batch: int  # examples in the step, every replica's together
    no_data: tuple[int, ...] = ()  # workers whose batch was empty (their data ended)

    @property
    def go(self) -> bool:
        return self.ending is Ending.RUNNING

    @property
    def workers(self) -> tuple[int, ...]:
        """The workers whose vote is the decision."""
        return tuple(i for i, v in enumerate(self.votes) if v is self.ending)

    @property
    def reason(self) -> str:
        if self.go:
            return "running"
        if self.ending is Ending.DRAIN and len(self.no_data) == len(self.votes):
            return "every worker's data ended"
        if self.ending is Ending.DRAIN and self.no_data:
            return f"the data of worker {_names(self.no_data)} ended"
        what = {Ending.DRAIN: "drains", Ending.STOP: "stops", Ending.FAIL: "failed"}[self.ending]
        return f"worker {_names(self.workers)} {what}"


def _names(workers: tuple[int, ...]) -> str:
    return ", ".join(str(w) for w in workers)


def decode(reduced: list[int], local_replicas: int) -> ClusterVerdict:
    """The verdict from the all-reduced ballot: (vote, batch size) per replica, workers'
    replicas consecutive (``replica_id_in_sync_group``)."""
    replicas = len(reduced) // 2
    votes = [Ending.RUNNING] * (replicas // local_replicas)
    no_data: set[int] = set()
    for replica in range(replicas):
        worker = replica // local_replicas
        vote, size = Ending(reduced[2 * replica]), reduced[2 * replica + 1]
        votes[worker] = max(votes[worker], vote)
        if size == 0:
            no_data.add(worker)
    return ClusterVerdict(max(votes), tuple(votes), sum(reduced[1::2]), tuple(sorted(no_data)))


def distribute(
    strategy: tf.distribute.Strategy,
    dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
    options: tf.distribute.InputOptions | None = None,
) -> Any:
    """``strategy.distribute_datasets_from_function(dataset_fn)`` with every worker's dataset
    of finite or unknown cardinality: an infinite one gets ``take(NEVER_ENDS)``. The strategy
    runs partial-batch handling (a collective inside ``get_next``) only for those, so a mix of
    infinite and finite datasets across workers would not run the same collectives."""

    def finite(context: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = dataset_fn(context)
        if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
            dataset = dataset.take(NEVER_ENDS)
        return dataset

    return strategy.distribute_datasets_from_function(finite, options=options)


class CollectiveStop:
    """``fetch`` and ``vote`` of the module docstring for one strategy and iterator."""

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        self.strategy = strategy
        self.replicas = strategy.num_replicas_in_sync
        self.local_replicas = len(strategy.extended.worker_devices)
        self.workers = self.replicas // self.local_replicas
        self._next = tf.function(self._next_fn)
        self._vote = tf.function(self._vote_fn)
        self._vote_ended = tf.function(self._vote_ended_fn)

    def fetch(self, iterator: Any) -> Any | None:
        """The step's per-replica batch; None once every worker's data ended (all together)."""
        try:
            return self._next(iterator)
        except tf.errors.OutOfRangeError:
            return None

    def vote(self, local: Ending, batch: Any | None) -> ClusterVerdict:
        """All-reduce this worker's vote with everyone's; the same verdict on every worker."""
        vote = tf.constant(int(local), tf.int32)
        reduced = self._vote_ended(vote) if batch is None else self._vote(batch, vote)
        reduced = self.strategy.experimental_local_results(reduced)[0].numpy()
        return decode([int(v) for v in reduced], self.local_replicas)

    @staticmethod
    def _next_fn(iterator: Any) -> Any:
        return next(iterator)

    def _vote_fn(self, batch: Any, local: tf.Tensor) -> Any:
        def ballot(batch: Any, local: tf.Tensor) -> tf.Tensor:
            return self._ballot(tf.shape(tf.nest.flatten(batch)[0])[0], local)

        return self.strategy.run(ballot, args=(batch, local))

    def _vote_ended_fn(self, local: tf.Tensor) -> Any:
        """The ballot once every worker's data ended: no batch, every size 0."""
        return self.strategy.run(lambda local: self._ballot(tf.constant(0), local), args=(local,))

    def _ballot(self, size: tf.Tensor, local: tf.Tensor) -> tf.Tensor:
        """(in a replica) this replica's vote (raised to ``DRAIN`` without a batch) and size in
        its slots, all-reduced."""
        context = tf.distribute.get_replica_context()
        mine = tf.where(size > 0, local, tf.maximum(local, int(Ending.DRAIN)))
        slots = tf.one_hot(context.replica_id_in_sync_group, self.replicas, dtype=tf.int32)
        ballot = tf.reshape(tf.stack([slots * mine, slots * size], axis=1), [-1])
        return context.all_reduce(tf.distribute.ReduceOp.SUM, ballot)
