"""``ServedFeed``: a TF 2 ``Feed`` whose batches come from producers over the network.

The five lines of a Keras user::

    options = stagefeed.TrainerOptions(bind="tcp://*:5555", schema=schema)
    with stagefeed.ServedFeed(options) as feed:          # producers connect to options.bind
        model.fit(feed.dataset(("images", "labels")), steps_per_epoch=100, epochs=3,
                  callbacks=[feed.callback()])
        print(feed.ledger.summary())                     # every batch: trained, queued, dropped

The intake (``consumer.intake.intake``) binds, speaks the protocol, checks every batch against the
schema and enqueues into the feed's queue (capacity from ``options.queue_mb``); the feed's
books report each step's batches to the same ``Ledger``. As the graph trainer does, a feed whose
``options.keep_freed_memory`` is set (the default) applies ``consumer.memory.malloc_policy`` to the
process: freed batch-sized buffers (received frames, the queue's copies, the batches the
pipeline hands the step) are reused instead of unmapped and faulted in again, which measured
13-15% of a Keras AlexNet step on 2 cores (docs/benchmarks.md). Lifecycle: construct (binds) ->
``dataset()`` once -> train -> ``close()`` (idempotent: no more credit, the queue closes so
blocked enqueues return, the intake's threads are joined).

The end of the data (``end_watch=True``, the default): the thread ``stagefeed-feed-end``
consults the run's ``RunEnd`` (``consumer.run_end``, the CLI trainers' rule) every
``WATCH_S``. Once every producer that said hello and delivered has said ``end``, every batch
they sent is in the queue, and that held for ``end_grace_s`` (late producers may still say
hello), it closes the queue: the dataset yields what is queued, then ends (``fit`` stops at
the end of that epoch, a ``for`` loop over the dataset ends). A failed intake closes the queue
too and ``check()`` raises the failure. ``KerasTrainer`` watches its run itself
(``end_watch=False``: it adds a stop event and the producers' health to the same rule).

Ctrl-C: a feed made in the main thread of a program that leaves SIGINT to Python closes its
queue on SIGINT (``consumer.tf2.feed_signals``), so a ``fit`` or a loop waiting in the dequeue
returns and the user's ``KeyboardInterrupt`` is raised; SIGTERM keeps its default.

Resume (docs/resume.md, "A custom loop"): ``ServedFeed(options, positions=True)`` books, per
shard, the batches its steps trained (the steps booked with ``books.step_done()``, or by the
Keras callback); ``position()``, read after the user saved their model, is what that model has
trained. ``ServedFeed(options, resume=position)`` starts from it (a position of a finished
run, every pass of ``options.epochs`` trained, is refused: ``ConfigError``): a producer's
welcome names the first batch its shard still owes (a seekable source starts there), and a
batch of the position that comes again is dropped as ``already_trained``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf

from stagefeed.common import tf_config
from stagefeed.common.errors import ConfigError
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition
from stagefeed.common.tf_config import ClusterPlace
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.books.shard_books import ShardBooks
from stagefeed.consumer.intake.intake import Intake
from stagefeed.consumer.memory import malloc_policy
from stagefeed.consumer.run_end import WATCH_S, Ending, RunEnd, Verdict, finished_because
from stagefeed.consumer.tf2 import pipeline
from stagefeed.consumer.tf2.feed import Feed
from stagefeed.consumer.tf2.feed_signals import SigintWake
from stagefeed.consumer.tf2.pass_gate import PassGate
from stagefeed.consumer.wait_line import WaitLine

log = logging.getLogger(__name__)

END_GRACE_S = 1.0  # how long the data must stay ended before the dataset ends
JOIN_TIMEOUT_S = 3.0


class ServedFeed(Feed):
    """A ``Feed`` bound on ``options.bind``; ``ledger`` holds the books (a new one unless
    given), ``endpoint`` the address producers connect to. ``positions``: book the input
    position per shard (``position()``); ``resume``: an ``InputPosition`` (or its
    ``to_dict()``, e.g. read back from JSON) to start from, which implies ``positions``.
    ``confirm_saves``: the loop calls ``saved(position)`` after each checkpoint it writes, and
    a producer that finished stays until a saved position holds its whole shard (else it
    leaves once its ``end`` is delivered); implies ``positions``. ``place``: where its trainer
    stands in a ``TF_CONFIG`` cluster (``tf_config.ClusterPlace``; None: this process's
    ``TF_CONFIG``)."""

    def __init__(
        self,
        options: TrainerOptions,
        configure_server: Callable[[Any], None] | None = None,
        ledger: Ledger | None = None,
        *,
        end_watch: bool = True,
        end_grace_s: float = END_GRACE_S,
        positions: bool = False,
        resume: InputPosition | Mapping[str, Any] | None = None,
        confirm_saves: bool = False,
        place: ClusterPlace | None = None,
    ) -> None:
        # Where this feed's trainer stands (a cluster worker's refuses a source with passes):
        # given by the trainer that made it, or this process's TF_CONFIG, read once here.
        self.place = tf_config.place() if place is None else place
        self.ledger = Ledger() if ledger is None else ledger
        if resume is not None or positions or confirm_saves:
            if self.ledger.shards is not None:
                raise ConfigError("resume/positions: the ledger given books positions already")
            if resume is not None and not isinstance(resume, InputPosition):
                resume = InputPosition.from_dict(resume, "ServedFeed(resume=...)")
            if resume is not None:
                _refuse_finished(resume, options)
            self.ledger.shards = ShardBooks(resume, confirms=confirm_saves)
            if resume is not None:
                log.info("the feed resumes from: %s", _describe(resume))
        super().__init__(
            options.schema,
            options.queue_capacity,
            stage_depth=options.stage_depth,
            device=options.device,
            sink=self.ledger,
        )
        if options.keep_freed_memory:
            malloc_policy.keep_freed_memory(options.schema.largest_array_bytes)
        self.intake = Intake(options, options.schema, self.enqueue, self.ledger, configure_server,
                             place=self.place)  # fmt: skip
        try:
            self.intake.start()
        except BaseException:
            super().close()
            raise
        self.endpoint = self.intake.endpoint
        self.options = options
        # Only a run of several passes has boundaries to end an iterator at (none: no
        # predicate in Python before each dequeue).
        self.gate = PassGate(self.queue, self._pass_boundaries) if options.epochs > 1 else None
        self._passes_reported = 0  # passes whose end the books' trained batches reached
        self._fit_epochs: int | None = None  # a fit whose epochs are passes: its epochs
        self._gated = True  # dataset(passes=True): fit's epochs may be passes
        self._served_closed = False
        self._stop = threading.Event()
        self.run_end = RunEnd(
            self._stop, self.intake.data_ended, [self.intake.check], end_grace_s=end_grace_s
        )
        self._watch: threading.Thread | None = None
        if end_watch:
            self._watch = threading.Thread(
                target=self._watch_end, name="stagefeed-feed-end", daemon=True
            )
            self._watch.start()
        # Ctrl-C while the dataset waits for data: the queue closes, KeyboardInterrupt follows.
        self._sigint = SigintWake(self.queue.close)
        self._sigint.start()

    def check(self) -> None:
        """Raise ``BrokenError`` if the intake failed (call between epochs or steps)."""
        self.intake.check()

    def dataset(
        self,
        mapping: pipeline.ElementMapping = None,
        *,
        strategy: tf.distribute.Strategy | None = None,
        cast: pipeline.CastWhere = "pipeline",
        passes: bool = True,
    ) -> tf.data.Dataset | tf.distribute.DistributedDataset:
        """``Feed.dataset``; ``passes``: its iterators may end at pass boundaries (``fit``
        given no ``steps_per_epoch`` trains one pass an epoch, ``consumer.tf2.pass_gate``).
        False: one iterator goes on across passes (the CLI's Keras trainer: ``PassCut``)."""
        if not passes:
            self.gate, self._gated = None, False
        return super().dataset(mapping, strategy=strategy, cast=cast)

    def fit_begins(self, epochs: int, steps: int | None) -> bool:
        """``fit(epochs=epochs)`` without ``steps_per_epoch`` (``steps`` None) on a source with
        passes: one epoch a pass. ``ConfigError`` (one line) if the producers make another
        number of passes than ``fit`` has epochs (``options.epochs``, told in the welcome)."""
        if steps is not None or not self._gated:
            return False
        self._fit_epochs = epochs
        self._check_epochs()
        if self.gate is not None:
            self.gate.cut = True
        return True

    def raise_owed_interrupt(self) -> None:
        """``KeyboardInterrupt`` now if a Ctrl-C came while the main thread was in
        TensorFlow's code (``feed_signals``): ``fit``'s callbacks run between its steps."""
        self._sigint.raise_owed()

    def passes_ended(self, trained: int) -> int:
        """Passes the first ``trained`` batches completed since the last call (logged). Waits
        until that is known, when nothing after them is queued yet: the pass's end (its
        boundary), a later batch of the same pass (the next pass's come after the boundary),
        or the queue closed. The next step would have waited for that batch anyway."""
        self._check_epochs()
        passes = self.intake.passes
        if self.gate is None or passes is None or not passes.active:
            return 0  # one pass at most: its end is the data's
        while True:
            enqueued = self.queue.wait_for_more(trained, WATCH_S)  # then the boundaries
            ended = passes.ended_by(trained, self._passes_reported)
            if ended or enqueued > trained or self.queue.closed:
                break
        for epoch, _ in ended:
            log.info("every shard's pass %d is trained: fit's epoch %d/%d ends", epoch,
                     epoch + 1, self.options.epochs)  # fmt: skip
        self._passes_reported += len(ended)
        return len(ended)

    def _check_epochs(self) -> None:
        passes = self.intake.passes
        fit_epochs = self._fit_epochs
        if fit_epochs is None or passes is None or not passes.active:
            return
        if fit_epochs != self.options.epochs:
            raise ConfigError(
                f"fit(epochs={fit_epochs}) on a source with passes whose producers make "
                f"TrainerOptions(epochs={self.options.epochs}) passes: an epoch is every "
                f"shard's pass; give TrainerOptions(epochs={fit_epochs})"
            )

    def _pass_boundaries(self) -> list[int]:
        """The batches enqueued when each pass ended (all of it in the queue)."""
        passes = self.intake.passes
        return [at for _, at in list(passes.boundaries)] if passes is not None else []

    def position(self) -> InputPosition:
        """What the booked steps trained, per shard (a copy): read it after saving the model,
        and pass it back as ``ServedFeed(options, resume=...)``. ``ConfigError`` if this feed
        books no positions (made without ``positions=True`` or ``resume``)."""
        return self._shard_books().position()

    def saved(self, position: InputPosition, finished: bool | None = None) -> None:
        """A checkpoint holding ``position`` (a ``position()`` read after its model) is
        written for good: the producers whose whole shard it holds may leave. ``finished``:
        the loop's last, of a run it will not resume: at ``close`` every producer may leave;
        None: as ``finished(position)`` says (the CLI trainers' rule). ``ConfigError`` if
        this feed books no positions."""
        if finished is None:
            finished = bool(self.finished(position))
        self._shard_books().saved(position, finished)

    def finished(self, position: InputPosition) -> str:
        """Why a run whose checkpoint holds ``position`` is done, or "" (``run_end.
        finished_because``, the CLI trainers' rule): every pass of ``options.epochs`` of a
        source with passes is trained, or every producer's data ended and all of it was
        trained. A loop's own plan of steps is the loop's to judge (``saved(p, True)``)."""
        drained = self.run_end.verdict.data_ended and self.figures().queued == 0
        return finished_because(step=0, planned_steps=0, planned_passes=self.options.epochs,
                                position=position, data_ended=drained)  # fmt: skip

    def _shard_books(self) -> ShardBooks:
        books = self.ledger.shards
        if books is None:
            raise ConfigError(
                "this feed books no input position: make it with ServedFeed(options, "
                "positions=True), or resume=POSITION"
            )
        return books

    def producer_name(self, peer: int) -> str:
        """The name the books give connection ``peer`` (a ``TrainedStep``'s ``peers``)."""
        return self.ledger.name(peer)

    def _watch_end(self) -> None:
        # While nothing arrives and the queue is empty, the user's program waits for data: say
        # so every wait_log_s, as the CLI's trainers do (a feed with no producer is not silent).
        line = WaitLine(self.options.wait_log_s, self.ledger.producer_count, self.endpoint)

        def act(verdict: Verdict) -> bool:
            line.starved(self.ledger.totals().received, self.queue.size())
            if verdict.ending is Ending.DRAIN:
                log.info("%s: the dataset ends once the queue is drained", verdict.reason)
            elif verdict.ending is Ending.FAIL:
                log.error("the feed failed (check() raises it): %s", verdict.reason)
            if verdict.ending is Ending.RUNNING:
                return False
            self.queue.close()  # queued batches stay; the dataset ends after them
            return True

        self.run_end.watch(self._stop, act)

    def close(self) -> None:
        if self._served_closed:
            return
        self._served_closed = True
        self._stop.set()
        if self._watch is not None:
            join_threads([self._watch], JOIN_TIMEOUT_S)
        self.intake.stop_granting()
        super().close()
        self.intake.close()
        self._sigint.close()  # last: it raises a KeyboardInterrupt still owed (feed_signals)


def _refuse_finished(position: InputPosition, options: TrainerOptions) -> None:
    """``ConfigError`` (one line) if ``position`` holds a finished run: every pass of
    ``options.epochs`` trained (``run_end.finished_because``, the CLI's rule): resuming it
    would train another pass."""
    why = finished_because(step=0, planned_steps=0, planned_passes=options.epochs,
                           position=position)  # fmt: skip
    if why:
        raise ConfigError(f"ServedFeed(resume=...): the position holds a finished run ({why}, "
                          f"TrainerOptions(epochs={options.epochs})): nothing to resume; make "
                          f"the feed without resume to train a new run")  # fmt: skip


def _describe(position: InputPosition) -> str:
    """``shard 0 at 57 (+1 above), shard 1 at 96``: the first batch each shard still owes."""
    streams = [
        f"shard {shard} at {p.next}" + (f" (+{len(p.above)} above)" if p.above else "")
        for shard, p in sorted(position.streams.items())
    ]
    return ", ".join(streams) or "nothing trained yet"
