"""One worker of a ``MultiWorkerMirroredStrategy`` cluster, trained from its own feed.

``stagefeed train`` with a Keras ``--model`` runs this trainer when ``TF_CONFIG`` names a
cluster (``consumer.trainers.trainer``); graph mode is refused there in one line. Keras 3's
``fit`` fails under the strategy (docs/scaling.md, keras-team/keras#20585), so the worker
trains with the cluster loop (``consumer.cluster.loop``): the compiled model's own loss,
optimizer and metrics in a distributed step, one collective vote per step so that every
worker stops after the same step.

Lifecycle, as every ``TrainerBase``: ``ClusterTrainer(options, ...)`` makes the strategy (the
process's first TensorFlow op: ``ConfigError`` otherwise) -> ``start()`` builds and checks the
model under the strategy's scope, binds this worker's ``ServedFeed`` (its own ``--bind``;
producers connect to every worker) -> ``train(stop)`` -> ``close()`` (idempotent).

The worker's own ``RunEnd`` (stop, intake and producer failures, the end of its data) is its
vote; a watcher thread, ``stagefeed-cluster-watch``, closes the feed's queue as soon as the
verdict is not ``RUNNING``, so a worker waiting for a batch that will not come returns and
votes. A stop or failure goes to the other workers too (``consumer.cluster.peer_stop``), whose
watchers close their queues in turn: a worker waiting for data (no producer yet) would not
reach the vote otherwise. While its queue stays empty the watcher logs the waiting line
(``consumer.wait_line``). Every worker books the batches its own steps trained, in its own
summary; only the chief keeps checkpoints and ``--save`` (``consumer.checkpoints``).

Resume (docs/resume.md, "Several trainer workers"): each shard feeds one worker, whose books
hold the batches its steps trained; the chief's checkpoint (only its ``--save DIR`` is read)
reaches every worker at start with its weights (``consumer.cluster.positions``), and every
checkpoint's position is the union of every worker's books, which the chief writes with the
model. Step numbers, ``--steps`` and checkpoints go on from the checkpoint's step. A
checkpoint that would leave the workers unequal batches (another number of workers) is
refused on every worker at start (``consumer.books.redeal.check_even``): the cluster would
stop at the first worker's last batch, the others' left untrained.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from stagefeed.common.errors import BrokenError
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import ClusterPlace
from stagefeed.consumer import model_ref
from stagefeed.consumer.books.redeal import check_even
from stagefeed.consumer.checkpoints import Checkpoints, ModelFormat, resume_point
from stagefeed.consumer.cluster import loop
from stagefeed.consumer.cluster.collective_stop import ClusterVerdict, vote_for
from stagefeed.consumer.cluster.peer_stop import PeerStop
from stagefeed.consumer.cluster.positions import share_resume, union_position
from stagefeed.consumer.cluster.shared_state import broadcast_variables, sum_over_workers
from stagefeed.consumer.cluster.strategy import Cluster, make_cluster
from stagefeed.consumer.keras_fit.resume_fit import keras_format, restore_iterations, restore_keras
from stagefeed.consumer.keras_fit.trainer import KerasTrainer
from stagefeed.consumer.run_end import Ending, RunEnd, Verdict
from stagefeed.consumer.run_facts import StepClock, StepObserver, StepRecord
from stagefeed.consumer.run_report import ClusterReport
from stagefeed.consumer.trainer_base import trainer_place
from stagefeed.consumer.wait_line import WaitLine

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


class ClusterTrainer(KerasTrainer):
    """A Keras model trained as one worker of the ``TF_CONFIG`` cluster; what it shares with
    ``KerasTrainer`` (the model's build and check, the feed, checkpoints, ``close``) it
    inherits, and it trains with the cluster loop instead of ``fit``.

    The strategy's input iterator is kept for the life of the trainer: TensorFlow 2.21 deletes
    its per-device iterators only once tf.data's autotune thread wakes from a sleep that
    doubles up to 60 s (``RootDataset::Iterator`` waits for ``Model::OptimizeLoop``; the
    per-device datasets ``MultiDeviceIterator`` builds take no options of ours, and the
    strategy has no input mode without them). ``stagefeed train`` ends the process without
    deleting it (``exit_without_teardown``); a process that drops the trainer waits there."""

    exit_without_teardown = True

    def __init__(
        self,
        options: TrainerOptions,
        observers: Sequence[StepObserver] = (),
        configure_server: Callable[[Any], None] | None = None,
        build: Callable[[Any], Any] | None = None,
        *,
        place: ClusterPlace | None = None,
    ) -> None:
        place = trainer_place(place)
        self.cluster: Cluster = make_cluster(place, join_s=options.cluster_join_s)  # first TF op
        super().__init__(options, observers, configure_server, build, place=place)
        self._clock = StepClock()
        self.cluster_totals: dict[str, int] | None = None  # after train(): every worker's books
        self._iterator: Any = None  # kept: see the class docstring

    def start(self) -> ClusterTrainer:
        plan = self.build_and_bind(self.cluster.strategy)
        assert self.model is not None  # build_and_bind made it
        log.info("Keras model %s on %s: x %s, y %s; a distributed step of its compiled loss, "
                 "optimizer and metrics", self.model.name, self.cluster, list(plan.inputs),
                 list(plan.targets))  # fmt: skip
        return self

    def model_format(self, model: Any) -> ModelFormat:
        """The Keras format, whose restore waits for ``book_positions``: every worker builds
        the optimizer under the strategy at the same point, then gets the chief's weights."""
        return dataclasses.replace(keras_format(model), restore=lambda path: None)

    def book_positions(self, model_format: ModelFormat) -> Checkpoints:
        """The chief's checkpoint (or a fresh start) on every worker: its weights, step and
        input position; then this worker's books, read as the cluster's union at each
        checkpoint (every worker, collectives in the same order). The run's ``Checkpoints``."""
        assert self.model is not None
        cluster, model, options = self.cluster, self.model, self.options
        # The chief decides (its restore waits: ``model_format``), then every worker has it.
        resumed = share_resume(cluster, resume_point(options, model_format, cluster.chief))
        if resumed is not None:
            check_even(resumed.position, cluster.count, f"the checkpoint {resumed.path}")
            with cluster.strategy.scope():
                if not model.optimizer.built:
                    model.optimizer.build(model.trainable_variables)
            if cluster.chief:
                restore_keras(model, resumed.model_path)
            broadcast_variables(
                cluster.strategy, _unique([*model.weights, *model.optimizer.variables])
            )
        books = self.resume_books(resumed, joined_only=True)
        self.step_base = resumed.step if resumed is not None else 0
        if resumed is not None:
            restore_iterations(model, self.step_base)
        return Checkpoints(
            options, model_format, cluster.chief, resumed=resumed,
            position=lambda: union_position(cluster, books), on_saved=books.saved,
        )  # fmt: skip

    def cluster_report(self) -> ClusterReport:
        """This worker's place and every worker's books (None if the run ended before they
        were summed), for the summary (``report``)."""
        cluster = self.cluster
        return ClusterReport(cluster.index, cluster.count, cluster.chief, self.cluster_totals)

    def train(self, stop: threading.Event, health_check: Callable[[], None] | None = None) -> None:
        """Train until the cluster's vote ends the run. Raises this worker's own failure
        (``BrokenError``, a producer's ``ConfigError``, ``NonFiniteLoss``), ``BrokenError``
        for another worker's failure or a broken cluster, and for a step that raised
        (``model_ref.step_failed``: one line naming the model; the same model fails the same
        step on every worker, and a worker left waiting in a collective finds the cluster
        broken once this one's process ended)."""
        assert self.feed is not None and self.model is not None
        feed = self.feed
        checks = [feed.check] + ([health_check] if health_check else [])
        run_end = RunEnd(stop, feed.intake.data_ended, checks)
        watch_done = threading.Event()
        watcher = threading.Thread(
            target=self._watch, args=(run_end, watch_done), name="stagefeed-cluster-watch",
            daemon=True,
        )  # fmt: skip
        watcher.start()
        self._clock.restart()
        try:
            total = self.options.total_steps
            self._iterator = iter(self._dataset)
            end = loop.train(
                self.cluster.strategy, self.model, self._iterator,
                steps=total - self.step_base if total else 0,
                local=lambda: vote_for(run_end.poll()),
                after_step=self._after_step,
                first_step=self.step_base + 1,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the model's or TensorFlow's error in the step
            log.debug("the cluster's loop raised", exc_info=True)
            raise model_ref.step_failed(self.options.model, exc) from None
        finally:
            watch_done.set()
            join_threads([watcher], JOIN_TIMEOUT_S)
            feed.books.end()
        mine = run_end.verdict
        # On every worker, before any raises: the books, and whether a worker will raise.
        self.cluster_totals, failed = self._sum_books(end.steps, mine.failure is not None)
        if mine.failure is not None:  # FAIL, or a drain after a producer's source failed
            raise mine.failure
        if end.verdict.ending is Ending.FAIL:
            raise BrokenError(f"cluster: {end.verdict.reason}")
        if end.verdict.ending is Ending.DRAIN:
            self.data_ended = mine.data_ended
            self.drained_because = end.verdict.reason
            self._say_untrained(end.verdict)
        if self.checkpoints is not None and not failed:  # a collective: every worker or none
            finished = end.verdict.reason if end.verdict.ending is Ending.DRAIN else ""
            self.checkpoints.final(self.steps_done, finished or self.finished(self.steps_done))
            # A barrier: past it, the chief has written the final state, so every worker
            # may let its producers go (``Checkpoints.confirm_written``).
            sum_over_workers(self.cluster.strategy, [0.0])
            self.checkpoints.confirm_written()

    def _say_untrained(self, verdict: ClusterVerdict) -> None:
        """(the chief) The batches other workers still held when the first worker's data
        ended: never trained, since the final state is finished (unequal data per worker)."""
        assert self.cluster_totals is not None
        left = self.cluster_totals["abandoned"] + self.cluster_totals["queued"]
        if self.cluster.chief and left and len(verdict.no_data) < len(verdict.votes):
            log.warning("cluster: %s first: %d batches the other workers held are not trained "
                        "(the workers had unequal data: docs/resume.md, 'Several trainer "
                        "workers')", verdict.reason, left)  # fmt: skip

    def _sum_books(self, steps: int, failed: bool) -> tuple[dict[str, int], int]:
        """The cluster's books: every worker's totals summed (one all-reduce, which every
        worker reaches here after the same last step), which the chief's summary carries;
        and how many workers ``failed`` (those raise their failure: no final checkpoint)."""
        totals = self.ledger.totals()
        names = ("received", "trained", "queued", "abandoned", "not_enqueued", "dropped",
                 "seq_missing")  # fmt: skip
        summed = sum_over_workers(
            self.cluster.strategy,
            [float(getattr(totals, name)) for name in names] + [float(failed)],
        )
        *counts, failed_workers = summed
        books = {name: round(value) for name, value in zip(names, counts, strict=True)}
        return {"workers": self.cluster.count, "steps": steps, **books}, round(failed_workers)

    def _watch(self, run_end: RunEnd, done: threading.Event) -> None:
        """Close the queue once this worker's verdict is not RUNNING, or once another worker
        said it stops or fails (``PeerStop``): a fetch waiting for a batch returns (the queued
        tail is still fetched), and the next vote carries it. A stop or failure of this
        worker's own is told to the others first. Meanwhile, the waiting line."""
        assert self.feed is not None
        queue = self.feed.queue
        peers = PeerStop(self.cluster.index)
        line = WaitLine(self.options.wait_log_s, self.ledger.producer_count, self.endpoint)

        def act(verdict: Verdict) -> bool:
            if verdict.ending is not Ending.RUNNING:
                if verdict.ending >= Ending.STOP:
                    peers.tell(verdict.reason)
                queue.close()
                return True
            news = peers.heard()
            if news is not None:
                log.info("cluster: %s; this worker takes no more batches and ends with it", news)
                queue.close()
                return True
            line.starved(self.steps_done, queue.size())
            return False

        run_end.watch(done, act)

    def _after_step(self, step: int, figures: dict[str, float]) -> None:
        """(the loop's thread) book the step this worker trained, show it, checkpoint."""
        assert self.feed is not None
        books = self.feed.books
        books.step_done(1)
        wait, step_s, now = self._clock.split(books.figures().wait_s)
        self.metrics_last = {k: v for k, v in figures.items() if k != "loss"}
        self._queued = self.feed.queue.size()
        record = StepRecord(
            step, step > self.options.warmup_steps, wait, step_s,
            figures.get("loss", float("nan")), self._queued, now,
        )  # fmt: skip
        self.book_step(record)  # NonFiniteLoss: the loss is all-reduced, the same everywhere
        self.epoch_ended(step)
        if self.checkpoints is not None:
            self.checkpoints.after_step(step)


def _unique(variables: list[Any]) -> list[Any]:
    """``variables`` without repeats (a weight may be listed twice), in order."""
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out
